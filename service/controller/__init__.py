"""The Kubernetes restart controller (``embedserve restart-controller``): evicts one pod at a
time when its hours to OOM run low, surging a replacement first. It runs as a Deployment of
its own (deploy/k8s/restart-controller.yaml), apart from ``embedserve up``."""
