"""The values a command's options choose among (kernels, precisions) and their bounds, in a module
that imports nothing heavy: the commands' parsers, and so --help, are built without torch."""

EXACT, FUSED, AUTO = "exact", "fused", "auto"
KERNELS = (AUTO, EXACT, FUSED)
PRECISIONS = ("fp32", "bf16", "fp16")
# pretrain's: auto is bf16 on CUDA, fp32 elsewhere; no fp16, which training would need loss scaling for
TRAIN_PRECISIONS = ("auto", "fp32", "bf16")
# The most torch CPU threads a worker may ask for: torch.set_num_threads(100000) kills the process
# (a segfault, after libgomp fails to start the threads), while 1024 runs; more threads than cores
# only slow a worker down, and the launching machine cannot know the workers' cores.
MAX_TORCH_THREADS = 1024
# pretrain's and probe's --seed: 32 bits, as most tools take; pretrain derives a stream's seed as
# seed * 1000003 + 17 + rank, which then stays far below torch.manual_seed's limit of 2**64
MAX_SEED = 2**32 - 1
EXPORT_DTYPES = ("float32", "float16", "bfloat16")  # weight types `export` stores
# a learning rate, decay or penalty weight is held in float32 tensors: past the largest float32 torch
# fails naming no option
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")
