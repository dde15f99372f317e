"""The node's HTTP control plane (see its /openapi.json)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPResponse
from typing import (
    Any,
    Callable,
    Dict,
    Generator,
    List,
    Literal,
    Mapping,
    Optional,
    Tuple,
    Union,
    cast,
    overload,
)

from .schema import (
    Cancelled,
    GateStatus,
    Result,
    ResultsPage,
    RolloutState,
    Sample,
    Submitted,
    Trace,
    TraceArrays,
)

Query = Mapping[str, Union[str, int, float]]


class NodeError(Exception):
    """An error answer from the node: `status`, `type` and `message` as the node gave them."""

    status: int
    type: Optional[str]
    message: Optional[str]

    def __init__(self, status: int, kind: Optional[str], message: Optional[str]) -> None:
        super().__init__(f"{status} {kind}: {message}")
        self.status = status
        self.type = kind
        self.message = message


class Node:
    """A rollout node at `url` (e.g. "http://127.0.0.1:8700"), with its bearer `token`."""

    def __init__(self, url: str, token: Optional[str] = None, timeout: float = 90.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        # Loopback and cluster-internal nodes must not go through an HTTP proxy from the env.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- plumbing ---------------------------------------------------------------------------

    @overload
    def _request(
        self,
        method: str,
        path: str,
        body: Optional[Mapping[str, Any]] = ...,
        query: Optional[Query] = ...,
        timeout: Optional[float] = ...,
        raw: Literal[False] = ...,
    ) -> Any: ...

    @overload
    def _request(
        self,
        method: str,
        path: str,
        body: Optional[Mapping[str, Any]] = ...,
        query: Optional[Query] = ...,
        timeout: Optional[float] = ...,
        *,
        raw: Literal[True],
    ) -> HTTPResponse: ...

    def _request(
        self,
        method: str,
        path: str,
        body: Optional[Mapping[str, Any]] = None,
        query: Optional[Query] = None,
        timeout: Optional[float] = None,
        raw: bool = False,
    ) -> Any:
        """The decoded JSON answer (None for an empty body), or with `raw=True` the open
        response; raises NodeError for an error status."""
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("content-type", "application/json")
        if self.token:
            req.add_header("authorization", f"Bearer {self.token}")
        try:
            resp = self._opener.open(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                err = json.loads(text)["error"]
                raise NodeError(e.code, err.get("type"), err.get("message")) from None
            except (ValueError, KeyError, TypeError):
                raise NodeError(e.code, "http_error", text) from None
        if raw:
            return cast(HTTPResponse, resp)
        with resp:
            return json.loads(resp.read() or b"null")

    # -- tasks ------------------------------------------------------------------------------

    def submit(self, task: Mapping[str, Any]) -> Submitted:
        """Submits a task spec (a dict); returns {"rollout_id", "samples"} at once."""
        return cast(Submitted, self._request("POST", "/v1/rollouts", body=task))

    def rollout(self, rollout_id: str) -> RolloutState:
        """{"rollout", "status": "running" | "done", "samples": [...]}."""
        return cast(RolloutState, self._request("GET", f"/v1/rollouts/{rollout_id}"))

    def cancel(self, rollout_id: str) -> Cancelled:
        """Cancels a rollout: its queued samples end at once, running agents are killed (those
        samples end "cancelled"); returns {"rollout_id", "stopping": how many were running}."""
        return cast(Cancelled, self._request("DELETE", f"/v1/rollouts/{rollout_id}"))

    def wait(self, rollout_id: str, timeout: Optional[float] = None) -> List[Sample]:
        """Blocks until every sample of the rollout has ended (following its event stream,
        and looking again if the stream breaks); returns the samples."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                for name, _ in self.events(rollout_id, timeout=timeout):
                    if name == "done":
                        break
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)  # the node restarted or the stream broke: look again
            state = self.rollout(rollout_id)
            if state["status"] == "done":
                return state["samples"]
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"rollout {rollout_id} is still running")

    def events(
        self, rollout_id: str, timeout: Optional[float] = None
    ) -> Generator[Tuple[str, Any], None, None]:
        """Yields (event, data) from the rollout's server-sent events: "snapshot", "stage",
        "finished", and last "done". `data` is the event's decoded JSON (a dict: the rollout
        and its samples for "snapshot", {"event", "rollout_id", "sample_id", "stage" or
        "outcome"} for "stage" and "finished", {"rollout_id"} for "done"), None if it had
        none."""
        resp = self._request(
            "GET", f"/v1/rollouts/{rollout_id}/events", timeout=timeout or 3600, raw=True
        )
        with resp:
            name: Optional[str] = None
            data: List[str] = []
            for raw_line in resp:
                line = raw_line.decode().rstrip("\n").rstrip("\r")
                if not line:
                    if name is not None:
                        yield name, json.loads("\n".join(data)) if data else None
                        if name == "done":
                            return
                    name, data = None, []
                elif line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip())

    # -- results ----------------------------------------------------------------------------

    def results(
        self, after: int = 0, wait: int = 30, limit: int = 100
    ) -> Tuple[List[Result], int]:
        """One page of finished samples after `after`: ([{"cursor", "sample"}], next_cursor).
        Waits up to `wait` seconds (at most 60) when there is none yet."""
        page: ResultsPage = self._request(
            "GET",
            "/v1/results",
            query={"after": after, "wait": wait, "limit": limit},
            timeout=max(self.timeout, wait + 30),
        )
        return page["results"], page["next"]

    def stream(
        self, after: int = 0, wait: int = 30, stop: Optional[Callable[[], bool]] = None
    ) -> Generator[Sample, None, None]:
        """Yields finished samples as they come, forever (or until `stop()` is true); keep
        the last `sample["_cursor"]` to resume from after a restart."""
        cursor = after
        while stop is None or not stop():
            items, cursor = self.results(after=cursor, wait=wait)
            for item in items:
                sample: Sample = {**item["sample"], "_cursor": item["cursor"]}
                yield sample

    def traces(self, sample_id: str) -> List[Trace]:
        """A finished sample's trace rows, as dicts (the trace schema: `tokentap schema --trace`)."""
        resp = self._request("GET", f"/v1/samples/{sample_id}/traces", raw=True)
        with resp:
            return [json.loads(line) for line in resp if line.strip()]

    @overload
    def trajectories(
        self, sample: Union[str, Mapping[str, Any]], numpy: Literal[False] = ...
    ) -> List[Trace]: ...

    @overload
    def trajectories(
        self, sample: Union[str, Mapping[str, Any]], numpy: Literal[True]
    ) -> List[TraceArrays]: ...

    @overload
    def trajectories(
        self, sample: Union[str, Mapping[str, Any]], numpy: bool = ...
    ) -> Union[List[Trace], List[TraceArrays]]: ...

    def trajectories(
        self, sample: Union[str, Mapping[str, Any]], numpy: bool = False
    ) -> Union[List[Trace], List[TraceArrays]]:
        """The traces of a sample (a dict from results/wait, or its id); with `numpy=True`
        each is a dict of arrays (see `as_arrays`)."""
        sample_id = sample if isinstance(sample, str) else sample["sample_id"]
        rows = self.traces(sample_id)
        if numpy:
            from .trajectories import as_arrays

            return [as_arrays(t) for t in rows]
        return rows

    # -- weight updates ---------------------------------------------------------------------

    def pause(self, wait: int = 300) -> GateStatus:
        """Holds new generations; returns once none is in flight ({"paused", "in_flight",
        "policy_version"}; in_flight > 0 means the wait ran out)."""
        return cast(
            GateStatus,
            self._request("POST", "/v1/admin/pause", query={"wait": wait}, timeout=wait + 30),
        )

    def resume(self, policy_version: Optional[str] = None) -> GateStatus:
        """Lets generations go on, under `policy_version` when given (the node's version then
        goes with every later call, over a task's own)."""
        body = {} if policy_version is None else {"policy_version": policy_version}
        return cast(GateStatus, self._request("POST", "/v1/admin/resume", body=body))

    def openapi(self) -> Dict[str, Any]:
        """The node's OpenAPI document."""
        return cast(Dict[str, Any], self._request("GET", "/openapi.json"))
