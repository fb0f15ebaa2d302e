"""A main()-style script that imports ncdp_fast.torch only after its process
group is initialised (issue 37), run under torchrun by
tests/test_distributed_exit.py: the "exit" case of _ranks_script.py (a
clipper across the ranks, destroy the group, exit) with the late import."""
import sys

from _ranks_script import C, SIGMA, model


def main():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if len(sys.argv) > 1 and sys.argv[1] == "pinned":     # the fix switched off
        import ncdp_fast.distributed._group as g
        g.unpin_world_defaults = lambda: None
    from ncdp_fast.torch import GhostClipper
    GhostClipper(model(dist.get_rank()), max_grad_norm=C, noise_multiplier=SIGMA,
                 expected_batch_size=4.0, group=dist.group.WORLD)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
