"""The pod runtime: plays, on this machine, the Pods of the local control plane that no container runtime runs.

By concern:
  volumes.py   configMap, secret, PVC (local/hostPath PVs), emptyDir, the projected SA token; bind_script
  network.py   the pod network (a bridge, a network namespace and IP per pod), the API server at the
               `kubernetes` Service's address, cluster DNS (a DNS server on the bridge, hosts files)
  users.py     runAsUser/runAsGroup/fsGroup: who a container runs as, volumes group-owned
  rootfs.py    a container's filesystem (a writable copy of its image, from the suite's image store: e2e/images)
               and what the image says to run (user, env, workdir, entrypoint, cmd)
  processes.py a container's env, its root laid out, its command and process tree
  kubelet.py   a Node this runtime is the kubelet of, and its pods: run, probed, status written, deleted
  logs.py      the kubelet's HTTPS server, which the API server calls, and its log endpoint (`kubectl logs`)
  portforward.py its port-forward endpoint, for websocket clients (`rlhf dashboard`)
  __main__.py  `python -m e2e.pods`: the kubelet as a process of its own (the dev cluster's node)
  devcluster.py `make dev-cluster-up`: a local cluster that trains, on that node, from the built images
  head.py      HeadPod: the older seam that plays only a RayJob's head from its template, KubeRay paused,
               on this machine's filesystem and virtualenv (no image)

Needs root (network namespaces, mounts) and iproute2, util-linux (unshare, nsenter), buildah; each
image brings its own setpriv (util-linux), as Debian's do.
"""
