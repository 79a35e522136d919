//! NCCL communicator (owned by the CUDA bridge work).
