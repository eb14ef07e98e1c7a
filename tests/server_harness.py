"""A real uvicorn server on 127.0.0.1 over an engine loop, in a thread of the test process: what the serving tests
(test_server.py, test_logprobs.py) talk HTTP to."""

from __future__ import annotations

import threading
import time

from qcompile.runtime.scheduler import Scheduler
from qcompile.runtime.server import Metrics, ModelInfo, bind, create_app, uvicorn_server
from qcompile.runtime.serving import EngineLoop


class Server:
    """A uvicorn server on 127.0.0.1 (any free port) over an engine loop, in a thread of this process."""

    def __init__(self, engine, tokenizer, eos_ids=(), chat_template=None, reasoning_parser=None,
                 tool_call_parser=None, prefix_cache=False):
        self.engine = engine
        self.metrics = Metrics()
        self.loop = EngineLoop(Scheduler(engine, prefix_cache=prefix_cache), self.metrics.on_state).start()
        self.info = ModelInfo("small", 512, engine.cache_cfg.max_context, tuple(eos_ids))
        app = create_app(self.loop, self.info, tokenizer, self.metrics, chat_template, reasoning_parser,
                         tool_call_parser)
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn_server(app, sock)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.loop.stop()

    def pool_full(self) -> bool:
        state = self.loop.state()
        return state.kv_pages_used == 0 and state.slots_used == 0 and state.running == state.waiting == 0

    def wait_pool_full(self, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while not self.pool_full():
            assert time.monotonic() < deadline, f"pages or slots still held: {self.loop.state()}"
            time.sleep(0.05)
