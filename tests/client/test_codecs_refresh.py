"""Every client encodes and decodes with the partition's current vocabulary.

A user re-registered a partition's enum field with another vocabulary from the
driver: a rollout client that had used the partition before kept its cached
vocabulary, wrote ``math`` as the old code of ``math``, and the driver read
``chat``; the reverse read raised a false ``CorruptPayload``. Clients now check
their cached codecs against the partition's (a fingerprint in every commit and
every read's answer) and fetch them again when they differ.
"""

from types import SimpleNamespace

import torch

OLD = ["math", "code", "chat"]
NEW = ["chat", "code", "math", "web"]


def _fields(words):
    return {"x": torch.arange(len(words), dtype=torch.int64).reshape(-1, 1), "step": words}


def test_a_reregistered_vocabulary_reaches_every_client(service, request):
    from dataplane_client import connect

    pid = f"codecs-{request.node.name}"
    driver = service.client()
    rollout = connect(service.config.name, service.config.namespace)
    try:
        driver.register_partition(pid, ["x", "step"], None, ["t"], enums={"step": OLD})
        rollout.put_samples(["a"], pid, _fields(["code"]))  # the rollout caches OLD
        assert rollout.get_samples(["a"], pid, ["step"])["step"] == ["code"]

        driver.register_partition(pid, ["x", "step"], None, ["t"], enums={"step": NEW})
        rollout.put_samples(["m"], pid, _fields(["math"]))  # written with NEW's code
        assert driver.get_samples(["m"], pid, ["step"])["step"] == ["math"]
        driver.put_samples(["w", "c"], pid, _fields(["web", "chat"]))  # codes OLD lacks
        assert rollout.get_samples(["w", "c", "m"], pid, ["step"])["step"] == [
            "web",
            "chat",
            "math",
        ]
    finally:
        rollout.close()
        driver.delete_partition(pid)


class _StaleCodecsOnce:
    """The controller's handle, except that its first ``field_codecs`` call answers
    ``stale``: what a fresh reader's first get sees when the partition is registered
    again between its codecs call and its locate (sent one after the other)."""

    def __init__(self, handle, stale):
        self._handle, self._stale, self.served = handle, stale, 0

    def __getattr__(self, name):
        if name == "field_codecs" and not self.served:
            import ray

            self.served += 1
            return SimpleNamespace(remote=lambda _partition_id: ray.put(self._stale))
        return getattr(self._handle, name)


def test_a_first_get_whose_codecs_answer_predates_a_registration_asks_again(service, request):
    """A reader with no codecs cached asks them beside the locate (not after the read);
    an answer older than the registration the locate saw is not used to decode."""
    import ray

    from dataplane_client import connect

    pid = f"codecs-{request.node.name}"
    driver = service.client()
    reader = connect(service.config.name, service.config.namespace)
    try:
        driver.register_partition(pid, ["x", "step"], None, ["t"], enums={"step": OLD})
        stale = ray.get(driver._open_controller().field_codecs.remote(pid))
        driver.register_partition(pid, ["x", "step"], None, ["t"], enums={"step": NEW})
        driver.put_samples(["m", "w"], pid, _fields(["math", "web"]))
        controller = _StaleCodecsOnce(reader._open_controller(), stale)
        reader._open_controller = lambda: controller
        assert reader.get_samples(["m", "w"], pid, ["step"])["step"] == ["math", "web"]
        assert controller.served == 1, "the get did not ask the codecs beside its locate"
    finally:
        reader.close()
        driver.delete_partition(pid)
