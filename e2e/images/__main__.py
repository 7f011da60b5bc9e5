import sys

from e2e import images

for name in sys.argv[1:] or ["operator", "trainer-cpu"]:
    images.build(images.BY_NAME[name])
print(images.run("podman", "images").stdout)
