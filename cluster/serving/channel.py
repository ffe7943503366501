"""The replica's connection to its engine actor: one TCP connection carrying pickled,
length-prefixed frames both ways, as vLLM's front end talks to its engine core.

    replica -> engine   ("add", call_id, request_id, prompt, params)   ("abort", request_id)
    engine -> replica   ("added", call_id, error or None)   ("updates", [RequestOutput])
                        ("dead", message): the engine loop stopped; the connection closes

Ray's calls cost the first token's path too much on a busy 2-core machine: at one client an
add reached the engine 1.6 ms after the replica sent it, and a batch of updates reached the
replica's routing 5 ms after the engine's poll returned (1.3 ms in the generator's yield,
2.5 ms before the replica held the reference, 1.5 ms to read it), of a median TTFT of 18 ms.

The engine actor listens on its node's address with a port of its own and hands the
address and a random token to its replica (`EngineActor.info`); the first connection that
presents the token is the replica's, and the listener closes. A reader that falls behind
blocks the sender once the socket's buffer is full: the engine loop's outbox coalesces
updates meanwhile, so a slow client gets fewer, larger updates instead of a backlog.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import queue
import secrets
import socket
import struct
import threading

log = logging.getLogger("adaspec.channel")
HEADER = struct.Struct("!I")  # the frame's length in bytes
TOKEN_BYTES = 16
SEND_BUFFER_BYTES = 64 * 1024
RECV_BYTES = 256 * 1024
POLL_WAIT_S = 1.0  # a poll with nothing to bring returns after this long (then the sender checks it should go on)
CONNECT_TIMEOUT_S = 10.0


def encode(message) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame goes out at once, not after the last ack


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class ChannelServer:
    """(in the engine actor) Serves the replica's connection: requests in on one thread
    (queued for the engine loop without waiting for its step), their answers and the
    engine loop's updates out on two others."""

    def __init__(self, loop, interval_s: float, host: str):
        """loop: the EngineLoop; interval_s: the least time between two batches of updates
        (a first text or an end goes at once)."""
        self.loop, self.interval_s = loop, interval_s
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1])
        self._conn: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()  # ("added", ...) frames to send; None: stop
        self._closed = False
        threading.Thread(target=self._serve, name="adaspec-channel", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._answers.put(None)
        for sock in (self._listener, self._conn):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def _serve(self) -> None:
        conn = self._accept()
        if conn is None:
            return
        self._conn = conn
        threading.Thread(target=self._send_updates, name="adaspec-channel-out", daemon=True).start()
        threading.Thread(target=self._send_answers, name="adaspec-channel-answers", daemon=True).start()
        self._read_requests()

    def _accept(self) -> socket.socket | None:
        """The first connection that presents the token; others are closed."""
        with self._listener:
            while not self._closed:
                try:
                    conn, _ = self._listener.accept()
                except OSError:
                    return None
                conn.settimeout(CONNECT_TIMEOUT_S)
                try:
                    given = _recv_exact(conn, TOKEN_BYTES)
                except OSError:
                    given = None
                if given is not None and hmac.compare_digest(given, self.token):
                    conn.settimeout(None)
                    _nodelay(conn)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
                    return conn
                conn.close()
        return None

    def _send(self, *messages) -> None:
        data = b"".join(encode(m) for m in messages)
        with self._send_lock:
            self._conn.sendall(data)

    def _read_requests(self) -> None:
        conn, buf = self._conn, bytearray()
        try:
            while True:
                data = conn.recv(RECV_BYTES)
                if not data:
                    return  # the replica went away: its streams with it
                buf += data
                messages = []
                while len(buf) >= HEADER.size and len(buf) >= (end := HEADER.size + HEADER.unpack_from(buf)[0]):
                    messages.append(pickle.loads(buf[HEADER.size:end]))
                    del buf[:end]
                self._handle(messages)
        except OSError:
            if not self._closed:
                log.debug("the replica's connection broke", exc_info=True)
        finally:
            self.close()  # the sender stops too

    def _handle(self, messages: list) -> None:
        """Adds and aborts, in arrival order, queued for the engine loop's next step; the adds'
        answers go out (`_send_answers`) once the loop has applied them."""
        requests, call_ids = [], []
        for message in messages:
            if message[0] == "add":
                requests.append(("add", *message[2:]))
                call_ids.append(message[1])
            elif message[0] == "abort":
                requests.append(message)
            else:
                log.error("unknown frame %r from the replica", message[0])
        if requests:
            self.loop.submit(requests, lambda errors: self._answers.put(
                [("added", call_id, error) for call_id, error in zip(call_ids, errors)]))

    def _send_answers(self) -> None:
        try:
            while (frames := self._answers.get()) is not None:
                if frames:
                    self._send(*frames)
        except OSError:
            if not self._closed:
                log.debug("the replica's connection broke", exc_info=True)
        finally:
            self.close()

    def _send_updates(self) -> None:
        from cluster.serving.engine_loop import EngineDeadError

        try:
            while not self._closed:
                try:
                    batch = self.loop.poll(POLL_WAIT_S, self.interval_s)
                except EngineDeadError as e:
                    self._send(("dead", str(e)))
                    break
                if batch:
                    self._send(("updates", batch))
        except OSError:
            if not self._closed:
                log.debug("the replica's connection broke", exc_info=True)
        finally:
            self.close()


class Channel:
    """(in the replica) The engine actor's end, on the replica's event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, address: tuple[str, int], token: bytes) -> "Channel":
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), CONNECT_TIMEOUT_S)
        _nodelay(writer.get_extra_info("socket"))
        writer.write(token)
        return cls(reader, writer)

    def send(self, message) -> None:
        self.writer.write(encode(message))

    async def receive(self):
        """The next frame; raises ConnectionError once the engine's end has closed."""
        try:
            header = await self.reader.readexactly(HEADER.size)
            body = await self.reader.readexactly(HEADER.unpack(header)[0])
        except asyncio.IncompleteReadError:
            raise ConnectionError("the engine actor closed its connection") from None
        return pickle.loads(body)

    def close(self) -> None:
        self.writer.close()
