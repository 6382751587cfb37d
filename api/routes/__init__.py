"""The API's routes, one router per resource. Each route parses the request,
is authorized by its router's dependencies, and calls one node action."""

from __future__ import annotations

from fastapi import APIRouter

from . import admin, builds, envd, images, node, peers, sandboxes, snapshots, templates, volumes

# the order requests are matched in, and the order of the OpenAPI document
ROUTERS: tuple[APIRouter, ...] = (node.router, sandboxes.router, snapshots.router, templates.router,
                                  images.router, peers.router, node.cache_router, admin.router,
                                  builds.router, builds.uploads, volumes.router, volumes.content, envd.router)
