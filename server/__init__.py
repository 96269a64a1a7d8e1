import time

# When the `specd` command's package was first imported, before pydantic, torch or a model:
# where `specd train-draft --total-minutes` starts counting when the process is the command.
IMPORTED_AT = time.monotonic()
