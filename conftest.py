pytest_plugins = ["e2e.fixtures", "e2e.parallel", "e2e.report"]
