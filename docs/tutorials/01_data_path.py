"""Tutorial 01: the data path, put -> claim -> shard per rank -> get -> write back -> clear.

Run it: ``.venv/bin/python docs/tutorials/01_data_path.py`` (about 20 s on 2 cores, most of
it starting Ray).

A rollout writes each sample's fields once into the store, keyed by sample id. The
driver claims *keys only* (a ``KVBatchMeta``: ids, fields, no tensors) and splits them
over data-parallel ranks with ``shard_meta_for_dp``; each rank fetches exactly its
slice with ``get_data`` and writes its result (here: per-token logprobs) back under the
same ids. Bytes move producer -> store -> consumer; the driver never holds a tensor.

- ``ensure_local_ray`` starts a local Ray on 127.0.0.1 (nothing if this process has
  one); ``start`` starts the service in it: a controller actor and a storage unit.
  Another process reaches it with ``dataplane_client.connect(name, namespace)``.
- ``input_ids`` is jagged (one tensor per sample, no padding); it comes back as a
  ``torch.nested`` jagged tensor.
- ``clear_samples(None, pid)`` deletes the partition and frees its bytes.

Next: ``02_claim_policy.py`` chooses *which* ready samples a claim hands out.
"""

import torch

from dataplane_client import DataPlaneConfig, shard_meta_for_dp
from dataplane_server import ensure_local_ray, start


def main() -> None:
    ensure_local_ray(num_cpus=4)  # 127.0.0.1; explicit CPUs: every actor holds one slot
    handle = start(DataPlaneConfig(name="tutorial-01", namespace="tutorials", admin_enabled=False))
    client = handle.client()  # elsewhere: dataplane_client.connect("tutorial-01", "tutorials")
    try:
        fields = ["input_ids", "rewards", "logprobs"]
        client.register_partition("step0", fields=fields, consumer_tasks=["train"])
        ids = [f"s{i}" for i in range(4)]
        prompts = [torch.arange(n) for n in (3, 5, 2, 4)]  # jagged: no padding stored
        client.put_samples(ids, "step0", {"input_ids": prompts, "rewards": torch.ones(4)})

        meta = client.claim_meta("step0", "train", ["input_ids", "rewards"], batch_size=4)
        per_rank, _ = shard_meta_for_dp(meta, dp_world=2)  # keys only: no bytes moved
        for rank, shard in enumerate(per_rank):  # in a trainer: each DP rank, in its process
            batch = client.get_data(shard)  # exactly this rank's rows
            logprobs = [-0.5 * row.float() for row in batch["input_ids"].unbind()]
            client.put_samples(shard.sample_ids, "step0", {"logprobs": logprobs})
            print(f"rank {rank}: {shard.sample_ids}")

        back = client.get_data(meta, select_fields=["logprobs"])["logprobs"]
        print("logprobs per sample:", [len(row) for row in back.unbind()])
        print("freed:", client.clear_samples(None, "step0").cleared, "samples")
    finally:
        client.close()
        handle.shutdown()


if __name__ == "__main__":
    main()
