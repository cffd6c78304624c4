"""The abstract DataPlaneClient: NeMo-RL's eight methods, with their exact signatures."""

import inspect

import pytest

from dataplane_client.interface import DataPlaneClient

CONTRACT = {
    "register_partition": "(self, partition_id, fields, num_samples, consumer_tasks, "
    "grpo_group_size=None, enums=None)",
    "claim_meta": "(self, partition_id, task_name, required_fields, batch_size, dp_rank=None, "
    "blocking=True, timeout_s=60.0)",
    "get_data": "(self, meta, select_fields=None)",
    "check_consumption_status": "(self, partition_id, task_names)",
    "put_samples": "(self, sample_ids, partition_id, fields=None, tags=None)",
    "get_samples": "(self, sample_ids, partition_id, select_fields)",
    "clear_samples": "(self, sample_ids, partition_id)",
    "close": "(self)",
}


def _bare(sig: inspect.Signature) -> str:
    """The signature with annotations stripped: names, order and defaults only."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_the_abc_has_exactly_the_eight_contract_methods():
    assert DataPlaneClient.__abstractmethods__ == frozenset(CONTRACT)


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_each_method_has_the_contract_signature_and_a_docstring(name):
    method = getattr(DataPlaneClient, name)
    assert _bare(inspect.signature(method)) == CONTRACT[name]
    assert method.__doc__
    assert method.__doc__.strip()


def test_an_implementation_missing_a_method_cannot_be_built():
    class Partial(DataPlaneClient):
        def close(self):
            return None

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_each_service_verb_is_declared_once_and_both_clients_take_it_from_there():
    """``DataPlaneService`` declares each verb once (signature, docstring, argument checks):
    both clients take the verb and its awaitable twin from it and write only its body."""
    from dataplane_client.client import RayDataPlaneClient
    from dataplane_client.interface import DataPlaneService, service_verbs
    from dataplane_server.core.inprocess import InProcessDataPlaneClient

    names = service_verbs(DataPlaneService)
    verbs = [v for v in names if v != "close" and not v.endswith("_async")]
    assert {"claim_meta", "policy_version", "ping"} <= set(verbs)
    assert sorted(names) == sorted([*verbs, *(f"{v}_async" for v in verbs), "close"])
    for name in verbs:
        sync, twin = getattr(DataPlaneService, name), getattr(DataPlaneService, f"{name}_async")
        assert inspect.signature(sync) == inspect.signature(twin)
        assert inspect.iscoroutinefunction(twin)
        assert not inspect.iscoroutinefunction(sync)
        assert sync.__doc__
        assert twin.__doc__ == sync.__doc__
    for cls in (RayDataPlaneClient, InProcessDataPlaneClient):
        assert not inspect.isabstract(cls)
        for name in verbs:
            for public in (name, f"{name}_async"):
                assert getattr(cls, public) is getattr(DataPlaneService, public), public
            assert f"_{name}" in vars(cls), f"{cls.__name__} writes no body for {name}"
