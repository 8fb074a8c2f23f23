import torch

# torch.optim imports torch._dynamo when the first optimizer is built (~0.8 s of CPU). Imported
# once here, it is inherited by every rank the harness forks, which would each import it again
# (as plait's launcher preloads it into its forkserver): the dist tests took 40% longer.
import torch._dynamo  # noqa: F401, E402

# One intra-op thread in the test process and, through fork, in every worker it starts: the
# machine has 2 cores, and oversubscribed ranks are many times slower.
torch.set_num_threads(1)
