"""specd test suites: one package, so suites and scripts import `tests.support` (see tests/support/__init__.py)."""
