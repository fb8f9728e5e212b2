"""gcp-storage-emulator with GCS's ``objects.moveTo`` added, run as the tests' GCS endpoint.

gcsfs renames with ``moveTo`` (GCS's same-bucket rename) and falls back to copy + delete only after
its retries on the emulator's refusal run out (about 30 s per rename); DCP renames its metadata
file on every save. The route does what GCS documents: the object appears under the new name and
is gone from the old one. Usage: ``python gcs_emulator.py PORT``."""

from __future__ import annotations

import json
import sys
from http import HTTPStatus

from gcp_storage_emulator import server
from gcp_storage_emulator.handlers import objects
from gcp_storage_emulator.settings import API_ENDPOINT


def move(request, response, storage, *args, **kwargs):  # type: ignore[no-untyped-def]
    request.params["dest_bucket_name"] = request.params["bucket_name"]
    objects.rewrite(request, response, storage)
    if response.status is not HTTPStatus.OK:
        return
    objects.delete(request, response, storage)
    response.json(json.loads(response._content)["resource"])


def main() -> None:
    route = (
        rf"^(?:{API_ENDPOINT})?/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$",
        {"POST": move},
    )
    server.HANDLERS = (route, *server.HANDLERS)
    server.create_server("127.0.0.1", int(sys.argv[1]), in_memory=True).run()


if __name__ == "__main__":
    main()
