"""A webhook receiver for diffmon's alert tests.

Verifies Standard-Webhooks signatures with the official `standardwebhooks` library (pinned in
python/requirements.txt), independently of diffmon, answers from a script of statuses, and logs
every request as one JSON line:
{"n", "path", "id", "signed", "valid", "status", "t", "body"}.

usage: test_receiver.py --port P --log FILE --port-file FILE [--script 500,500,429]
                        [--always STATUS] [--retry-after SECONDS] [--hang SECONDS]
A status of 0 in the script means: hold the request --hang seconds (default 30) without
answering, then close the connection.
The signing secret comes from the environment variable RECEIVER_SECRET (absent: no check).
"""

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, default=0)
parser.add_argument("--log", required=True)
parser.add_argument("--port-file", required=True)
parser.add_argument("--script", default="")
parser.add_argument("--always", type=int, default=200)
parser.add_argument("--retry-after", default="")
parser.add_argument("--hang", type=float, default=30.0)
args = parser.parse_args()

SECRET = os.environ.get("RECEIVER_SECRET")
SCRIPT = [int(s) for s in args.script.split(",") if s]
LOCK = threading.Lock()
COUNT = [0]


def verify(headers, body):
    """(signed, valid): signed when the three Standard-Webhooks headers are present, valid when
    the official library accepts the request (signature, 5 minute timestamp tolerance)."""
    if not all(headers.get(h) for h in ("webhook-id", "webhook-timestamp", "webhook-signature")):
        return False, False
    if SECRET is None:
        return True, False
    try:
        Webhook(SECRET).verify(body, dict(headers.items()), json_parse=False)
    except WebhookVerificationError:
        return True, False
    return True, True


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        signed, valid = verify(self.headers, body)
        with LOCK:
            n = COUNT[0]
            COUNT[0] += 1
            status = SCRIPT[n] if n < len(SCRIPT) else args.always
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            line = {
                "n": n,
                "path": self.path,
                "id": self.headers.get("webhook-id"),
                "signed": signed,
                "valid": valid,
                "status": status,
                "t": time.time(),
                "body": parsed,
            }
            with open(args.log, "a") as f:
                f.write(json.dumps(line) + "\n")
        if status == 0:
            time.sleep(args.hang)
            return
        payload = b"ok" if status < 400 else b"receiver says no: status %d" % status
        self.send_response(status)
        if status == 429 and args.retry_after:
            self.send_header("Retry-After", args.retry_after)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *a):
        pass


server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
tmp = args.port_file + ".tmp"
with open(tmp, "w") as f:
    f.write(str(server.server_address[1]))
os.replace(tmp, args.port_file)
server.serve_forever()
