"""The kubelet Device Plugin API v1beta1: servers, registration and kubelet watch."""
