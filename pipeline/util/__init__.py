"""The bottom layer, used by every other: the one user-error type (errors.py), the spelling of a
switch that turns a part off (switches.py), the cache root (paths.py), private folders for code we
build and load (private_folder.py, private_tmp.py), which CPUs a rank runs on (cores.py) and big
buffers in huge pages (huge_pages.py). Nothing here imports MLX or another layer of pipeline."""
