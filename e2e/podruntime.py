"""The head-pod seam's old home: HeadPod is e2e/pods/head.py, the volume helpers e2e/pods/volumes.py."""

from e2e.pods.head import HeadPod
from e2e.pods.volumes import Mount, Volume, bind_script

__all__ = ["HeadPod", "Mount", "Volume", "bind_script"]
