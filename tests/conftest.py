import torch

# One intra-op thread in the test process and, through fork, in every worker it starts: the
# machine has 2 cores, and oversubscribed ranks are many times slower.
torch.set_num_threads(1)
