"""The threaded multi-GPU pipeline: prefetcher -> target workers -> drafter workers.

One process, one thread per device role. Every module here is usable on CPU (tests) and CUDA.

Why threads in one process rather than one rank per GPU (torch.distributed): the GPUs do
different jobs (frozen target replicas on some, drafter replicas on others), and every step
hands the target's hidden states to a drafter. In one address space that hand-off is a device
copy into a pre-allocated slot released by a CUDA event (features.py), and the drafter
replicas' gradients are summed with in-process NCCL on their own streams (trainer/distributed/grad_sync.py); ranks
would have to send those tensors between processes and each hold a copy of the tokenized data.
The threads do not fight over the GIL in the steady state: they mostly wait on CUDA kernels,
which release it. One process also means one writer of status.json, metrics.jsonl, control/
and the checkpoints. Across hosts: one rank per host, with these threads unchanged inside it.
"""
