#!/usr/bin/env bash
# Regenerates the *_pb2.py and *_pb2_grpc.py modules beside this script from its .proto files, with the
# pinned generator (the versions the kubernetes extra in pyproject.toml accepts at run time follow from it):
#   pip install grpcio-tools==1.85.1 && bash daemon/kubelet/generate.sh
# The protos are compiled under their installed path (cuctxd/daemon/kubelet/), so that the generated
# _grpc modules import their messages as cuctxd.daemon.kubelet.*_pb2.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
view="$(mktemp -d)"
trap 'rm -rf "$view"' EXIT
mkdir -p "$view/cuctxd/daemon/kubelet"
cp "$here"/*.proto "$view/cuctxd/daemon/kubelet/"
cd "$view"
"${PYTHON:-python3}" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. cuctxd/daemon/kubelet/*.proto
cp cuctxd/daemon/kubelet/*_pb2*.py cuctxd/daemon/kubelet/*_pb2.pyi "$here/"
