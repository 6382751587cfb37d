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


@router.post("/templates/tags", status_code=201, response_model=m.AssignedTemplateTags,
             summary="E2B's Template.assign_tags: NAME:TAG2 for each tag names what NAME:TAG names")
def assign_tags(body: m.AssignTemplateTags, node: NodeDep, caller: CallerDep) -> m.AssignedTemplateTags:
    return node.catalog.assign_tags(caller, body.target, body.tags)


@router.delete("/templates/tags", status_code=204, summary="E2B's Template.remove_tags")
def remove_tags(body: m.DeleteTemplateTags, node: NodeDep, caller: CallerDep) -> Response:
    node.catalog.remove_tags(caller, body.name, body.tags)
    return Response(status_code=204)


@router.get("/templates/{templateID}/tags", response_model=list[m.TemplateTag], summary="E2B's Template.get_tags")
def template_tags(templateID: str, node: NodeDep, caller: CallerDep) -> list[m.TemplateTag]:
    return node.catalog.tags(caller, templateID)


# after /templates/tags: FastAPI tries routes in order
@router.delete("/templates/{templateID}", status_code=204)
def delete_template(templateID: str, node: NodeDep, caller: CallerDep) -> Response:
    node.catalog.delete_template(caller, templateID)
    return Response(status_code=204)
