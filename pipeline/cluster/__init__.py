"""The ring's wiring: messages between ranks (transport.py over MPI, or MLX's distributed ring /
JACCL set up in mlx_group.py), failing together (mpi.py), hostfiles (hostfile.py) and each rank's
supervisor that names a killed rank and ends the job (supervise.py)."""
