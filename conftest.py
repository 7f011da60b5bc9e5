pytest_plugins = ["e2e.fixtures"]
