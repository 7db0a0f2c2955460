"""FileService: uploads and downloads (transfer/), translated from and to the proto."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf import json_format

from sandboxd_contract.pb import sandboxd_pb2 as pb
from sandboxd_contract.pb import sandboxd_pb2_grpc as pb_grpc

from sandboxd.api.auth import Authenticator
from sandboxd.api.messages import message_to_json
from sandboxd.core.errors import Aborted
from sandboxd.transfer.service import FileTransfers, UploadPart


def _target(target: pb.TransferTarget) -> dict[str, Any]:
    raw: dict[str, Any] = {"workspace": target.workspace, "leaseId": target.lease_id}
    if target.HasField("policy"):
        raw["policy"] = message_to_json(target.policy)
    return raw


def _parts(requests: Iterator[pb.UploadRequest], context: grpc.ServicerContext) -> Iterator[UploadPart]:
    """The upload's messages; its end only when the client ended it. A stream cut off (the
    client gone, the idle watchdog) raises: an upload cut short must never land."""
    try:
        for request in requests:
            yield UploadPart(target=_target(request.target) if request.HasField("target") else None,
                             path=request.path,
                             entry=message_to_json(request.entry) if request.HasField("entry") else None,
                             data=bytes(request.data), commit=request.commit)
    except grpc.RpcError:
        raise Aborted("the client's stream broke off before the upload ended: nothing of it landed") from None
    if not context.is_active():
        raise Aborted("the upload was cut off before it ended (the client went quiet): nothing of it landed")


def _entry(entry: dict[str, Any]) -> pb.TransferEntry:
    return json_format.ParseDict(entry, pb.TransferEntry(), ignore_unknown_fields=True)


def _result(result: dict[str, Any]) -> pb.TransferResult:
    return pb.TransferResult(transfer_id=result["transferId"], entries=[_entry(e) for e in result["entries"]],
                             total_bytes=result["totalBytes"], skipped=result.get("skipped", []))


class FileServicer(pb_grpc.FileServiceServicer):
    def __init__(self, transfers: FileTransfers, authenticate: Authenticator):
        self._transfers = transfers
        self._authenticate = authenticate

    def Upload(self, request_iterator: Iterator[pb.UploadRequest], context: grpc.ServicerContext) -> pb.TransferResult:
        caller = self._authenticate(context)
        return _result(self._transfers.upload(_parts(request_iterator, context), caller))

    def Download(self, request: pb.DownloadRequest, context: grpc.ServicerContext) -> Iterator[pb.DownloadChunk]:
        caller = self._authenticate(context)
        for kind, value in self._transfers.download(_target(request.target), request.path, caller):
            if kind == "data":
                yield pb.DownloadChunk(data=value)
            elif kind == "entry":
                yield pb.DownloadChunk(entry=_entry(value))
            elif kind == "done":
                yield pb.DownloadChunk(entry=pb.TransferEntry(sha256=value["sha256"]))
            else:
                yield pb.DownloadChunk(result=_result(value))
