#!/usr/bin/env bash
# Makes the cluster's certificates and kubeconfigs in $run_dir/pki (openssl,
# P-256, about a second): a CA; the API server's serving certificate (service
# IP, node address, kubernetes.default.svc); client certificates for the admin
# (system:masters), the controller manager, the scheduler, the kubelet
# (system:node:<node>) and the API server's own calls to the kubelet; and the
# service-account signing key pair.
#
# usage: hack/cluster/certs.sh
set -euo pipefail
# shellcheck source=hack/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pki=$run_dir/pki
mkdir -p "$pki"
cd "$pki"
umask 077

key() { openssl ecparam -name prime256v1 -genkey -noout -out "$1.key" 2>/dev/null; }

key ca
openssl req -x509 -new -key ca.key -sha256 -days 30 -subj "/CN=gpu-node-agent-cluster-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.crt 2>/dev/null

# usage: cert NAME SUBJECT EXTENDED_KEY_USAGE [SUBJECT_ALT_NAMES]
cert() {
    local name=$1 subject=$2 usage=$3 san=${4:-}
    key "$name"
    openssl req -new -key "$name.key" -subj "$subject" -out "$name.csr" 2>/dev/null
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=$usage"
        if [[ -n $san ]]; then echo "subjectAltName=$san"; fi
    } >"$name.ext"
    openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 30 \
        -extfile "$name.ext" -out "$name.crt" 2>/dev/null
    rm -f "$name.csr" "$name.ext"
}

cert apiserver "/CN=kube-apiserver" serverAuth \
    "IP:$service_ip,IP:$node_ip,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" clientAuth
cert kubelet-serving "/CN=$node_name" serverAuth "IP:$node_ip,DNS:$node_name"
cert admin "/O=system:masters/CN=cluster-admin" clientAuth
cert kube-controller-manager "/CN=system:kube-controller-manager" clientAuth
cert kube-scheduler "/CN=system:kube-scheduler" clientAuth
cert kubelet "/O=system:nodes/CN=system:node:$node_name" clientAuth
key sa
openssl ec -in sa.key -pubout -out sa.pub 2>/dev/null

# usage: kubeconfig NAME (uses NAME.crt and NAME.key)
kubeconfig() {
    cat >"$1.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
  - name: local
    cluster:
      server: https://127.0.0.1:$apiserver_port
      certificate-authority: $pki/ca.crt
users:
  - name: $1
    user:
      client-certificate: $pki/$1.crt
      client-key: $pki/$1.key
contexts:
  - name: local
    context: {cluster: local, user: $1}
current-context: local
KC
}
for name in admin kube-controller-manager kube-scheduler kubelet; do kubeconfig "$name"; done
