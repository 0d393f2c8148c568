"""Batch reuse, for `eval run` only: a batch's packs laid out so the server's prefix cache serves one
instance's first request from another's.

- `ordering`: the batch's base commits cut into runs, each with its file order, base and root, stored
  under the batch's id before the instances start (`order_for_commits`);
- `delta`: delta packs, a run's root's files and then the diffs to the instance's commit;
- `packer`: `BatchPacker`, what `eval run` hands the agent (`Agent(packer=...)`).

Plain `fix` and library use never import this package.
"""
