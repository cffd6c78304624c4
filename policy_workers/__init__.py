"""Policy workers on the data plane: the top layer (imports dataplane_client, never the reverse).

Code map (one job per module; nothing is imported here, so ``import
policy_workers`` stays cheap):

- ``sharding``: ``NamedSharding``, the (PP, DP, CP, TP) rank layout with named axes;
- ``worker_group``: ``RayWorkerGroup`` / ``DistributedWorker``: actors in one
  torch.distributed world, replica / TP / DP groups, dispatch helpers;
- ``config``: ``PolicyConfig`` and its parts (model, batching, optimizer, loss);
- ``model``: transformers causal LM with a vocab-parallel output projection;
- ``loss``: GRPO clipped policy-gradient loss with the reference-policy KL penalty;
- ``broadcast``: two-phase broadcast of a BatchedDataDict in a replica group;
- ``tq_mixin``: ``TQWorkerMixin``, per-rank fetch / write-back / ``*_presharded``;
- ``recording``: opt-in, bounded bookkeeping of fetches, write-backs and dispatches
  (tests, the demo); off, the data path computes nothing for it;
- ``worker``: ``PolicyWorker``, the actor body (logprobs, reference logprobs, train);
- ``tq_policy``: ``TQPolicy``, the driver (metas on the data-plane path, tensors
  on the classic path; ``save_checkpoint`` / ``load_checkpoint``);
- ``checkpoint``: the policy checkpoint directory (manifest, checksums, atomic);
- ``errors``: ``PolicyWorkerLost`` and the checkpoint errors;
- ``rollout``, ``demo``, ``demo_report``, ``demo_checkpoint``: rollout actors,
  the end-to-end demo, what it prints, and its run checkpoint (store + policy).
"""
