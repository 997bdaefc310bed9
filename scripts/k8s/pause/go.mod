// The pod sandbox's process (no registry is reachable for the upstream pause image).
module greenroom.invalid/k8s/pause

go 1.26.0
