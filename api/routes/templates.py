"""Templates: a name for an imported image or a snapshot, what sandboxes are created from."""

from __future__ import annotations

from fastapi import APIRouter, Response

from .. import models as m
from ..deps import AUTH, CallerDep, NodeDep

router = APIRouter(tags=["templates"], dependencies=AUTH)


@router.get("/templates", response_model=list[m.Template])
def list_templates(node: NodeDep, caller: CallerDep) -> list[m.Template]:
    return node.catalog.templates(caller)


@router.post("/templates", status_code=201, response_model=m.Template,
             summary="Strata: name an imported image or a snapshot as a template")
def create_template(body: m.NewTemplate, node: NodeDep, caller: CallerDep) -> m.Template:
    return node.catalog.create_template(caller, body.name, image=body.image, snapshot=body.snapshot)


@router.get("/templates/aliases/{alias}", response_model=m.TemplateAlias)
def template_alias(alias: str, node: NodeDep, caller: CallerDep) -> m.TemplateAlias:
    return node.catalog.template_alias(caller, alias)


@router.delete("/templates/{templateID}", status_code=204)
def delete_template(templateID: str, node: NodeDep, caller: CallerDep) -> Response:
    node.catalog.delete_template(caller, templateID)
    return Response(status_code=204)
