"""The optimizers and what steps with them: the optimizer and LR schedule a config names
(build.py), Muon distributed over the ranks that hold a matrix's pieces (muon.py, muon_routes.py,
whole_matrices.py), fp16's dynamic loss scale (loss_scaling.py)."""
