"""The pod runtime: plays, on this machine, the Pods of the local control plane that no container runtime runs.

By concern:
  volumes.py   configMap, secret, PVC (local/hostPath PVs), emptyDir, the projected SA token; bind_script
  network.py   the pod network (a bridge, a network namespace and IP per pod), the API server at the
               `kubernetes` Service's address, cluster DNS (a DNS server on the bridge, hosts files)
  users.py     runAsUser/runAsGroup/fsGroup: who a container runs as, volumes group-owned
  processes.py the "image" (this machine's virtualenv), a container's env, command and process tree
  kubelet.py   a Node this runtime is the kubelet of, and its pods: run, probed, status written, deleted
  head.py      HeadPod: the older seam that plays only a RayJob's head from its template, KubeRay paused

Needs root (network namespaces, mounts, setpriv) and iproute2, util-linux (unshare, nsenter, setpriv).
"""
