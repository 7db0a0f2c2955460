"""PoolService: leases on warm sandboxes (pools/), each lease its principal's alone."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import json_format

from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc

from sandboxd.api.auth import Authenticator
from sandboxd.api.messages import message_to_json
from sandboxd.calls.executor import CallExecutor
from sandboxd.core.errors import NotFound, PermissionDenied


class PoolServicer(pb_grpc.PoolServiceServicer):
    def __init__(self, executor: CallExecutor, authenticate: Authenticator):
        self._executor = executor
        self._authenticate = authenticate

    @staticmethod
    def _template(request: pb.AcquireSandboxRequest) -> dict[str, Any]:
        raw: dict[str, Any] = {"toolId": "sandboxd.pool", "argv": ["supervisor"], "workspace": request.workspace,
                               "authorization": {"status": "not_required"}}
        if request.HasField("policy"):
            raw["policy"] = message_to_json(request.policy)
        if request.HasField("runtime"):
            runtime = message_to_json(request.runtime)
            runtime.pop("leaseId", None)
            runtime.pop("idempotencyKey", None)
            raw["runtime"] = runtime
        return raw

    def CreatePool(self, request: pb.CreatePoolRequest, context: grpc.ServicerContext) -> pb.PoolStatus:
        caller = self._authenticate(context)
        status = self._executor.create_pool(self._template(request.sandbox), caller)
        return json_format.ParseDict(status, pb.PoolStatus())

    def AcquireSandbox(self, request: pb.AcquireSandboxRequest, context: grpc.ServicerContext) -> pb.Lease:
        caller = self._authenticate(context)
        lease = self._executor.acquire(self._template(request), caller, request.lease_ms, request.wait_ms)
        return json_format.ParseDict(lease.to_json(), pb.Lease())

    def ReleaseSandbox(self, request: pb.ReleaseSandboxRequest,
                       context: grpc.ServicerContext) -> pb.ReleaseSandboxResponse:
        caller = self._authenticate(context)
        if self._executor.pools is None:
            raise NotFound(f"no lease {request.lease_id}", field="leaseId")
        self._executor.pools.release(request.lease_id, caller)
        return pb.ReleaseSandboxResponse()

    def ListPools(self, request: pb.ListPoolsRequest, context: grpc.ServicerContext) -> pb.ListPoolsResponse:
        caller = self._authenticate(context)
        # Pool keys name workspaces: a principal sees the pools it made, an admin all.
        pools = [] if self._executor.pools is None else self._executor.pools.list(None if caller.admin else caller.name)
        return pb.ListPoolsResponse(pools=[json_format.ParseDict(p, pb.PoolStatus()) for p in pools])

    def DrainPool(self, request: pb.DrainPoolRequest, context: grpc.ServicerContext) -> pb.DrainPoolResponse:
        if not self._authenticate(context).admin:
            raise PermissionDenied("draining pools is for admin principals")
        n = self._executor.pools.drain(request.pool_key) if self._executor.pools is not None else 0
        return pb.DrainPoolResponse(destroyed=n)
