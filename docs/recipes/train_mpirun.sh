#!/bin/bash
# linen-moe train under Open MPI 4: one rank per GPU on every host of a
# hostfile, joined by jax.distributed, which reads mpirun's environment
# (OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_SIZE and _RANK); no --coordinator
# flags. (Open MPI 5 also needs `pip install mpi4py`.)
#
#   NP=16 HOSTFILE=hosts ./train_mpirun.sh --config tiny_mixtral --steps 10000
#
# HOSTFILE lists the hosts, one a line ("node1 slots=8"); without it every
# rank runs on this host. MPIRUN_OPTS adds mpirun options (as root:
# --allow-run-as-root; more ranks than cores: --oversubscribe).
set -euo pipefail

NP=${NP:-16}
RUN_DIR=${RUN_DIR:-$HOME/linen-moe-runs/mpirun-$(date +%Y%m%d-%H%M%S)}

# -x passes variables to the remote ranks (the local ones inherit them all:
# add -x XLA_FLAGS and the like for what your ranks need);
# --map-by slot fills each host's slots in turn, so that rank i of a host
# gets local device i (OMPI_COMM_WORLD_LOCAL_RANK).
# shellcheck disable=SC2086
exec mpirun -np "$NP" ${HOSTFILE:+--hostfile "$HOSTFILE"} --map-by slot \
  -x PATH -x LD_LIBRARY_PATH \
  ${MPIRUN_OPTS:-} \
  linen-moe train --checkpoint-dir "$RUN_DIR" "$@"
