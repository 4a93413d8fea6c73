"""Admin API for experiments across adapters (each a registry op): create (and start), list, status
with per-arm figures, pause, resume, and stop with a winner. An ``admin`` key manages its own
tenant's experiments, a ``platform_admin`` key any tenant's. A request reaches an experiment as
``model: "experiment:<name>"`` or through a routing policy's ``experiment`` target."""

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.gateway.admin import ERRORS, actor, registry_call, scoped_tenant
from services.gateway.admin_routing import WRITE_ERRORS
from services.gateway.auth import Principal, admin_caller
from shared.schemas import (
    ARM_PATTERN,
    EXPERIMENT_PATTERN,
    MAX_ARMS,
    MIN_ARMS,
    CreateExperimentRequest,
    ExperimentArm,
    ExperimentReply,
    ExperimentsReply,
    ExperimentState,
    ExperimentStateRequest,
    ExperimentStatusReply,
    GetExperimentRequest,
    Identifier,
    ListExperimentsRequest,
    check_arms,
)

router = APIRouter(prefix="/admin", tags=["admin"])
NAME = Path(pattern=EXPERIMENT_PATTERN)


class ExperimentBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: Identifier | None = Field(default=None, description="default: the caller's tenant")
    name: str = Field(pattern=EXPERIMENT_PATTERN)
    arms: list[ExperimentArm] = Field(min_length=MIN_ARMS, max_length=MAX_ARMS, description="the first: the control")

    @field_validator("arms")
    @classmethod
    def _unique(cls, arms: list[ExperimentArm]) -> list[ExperimentArm]:
        return check_arms(arms)


class StateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: Identifier | None = Field(default=None, description="default: the caller's tenant")


class StopBody(StateBody):
    winner: str = Field(pattern=ARM_PATTERN, description="the arm every request is served from now on")


def _tenant(caller: Principal, tenant_id: str | None) -> str:
    return scoped_tenant(caller, tenant_id) or caller.tenant_id


@router.get("/experiments", response_model=ExperimentsReply, responses=ERRORS)
async def list_experiments(
    request: Request, tenant: Identifier | None = None, caller: Principal = Depends(admin_caller)
) -> ExperimentsReply:
    """The tenant's experiments, whatever their state."""
    message = ListExperimentsRequest(tenant_id=_tenant(caller, tenant))
    return await registry_call(request, "experiments", message, ExperimentsReply)


@router.post("/experiments", response_model=ExperimentReply, status_code=201, responses=WRITE_ERRORS)
async def create_experiment(
    body: ExperimentBody, request: Request, caller: Principal = Depends(admin_caller)
) -> ExperimentReply:
    """Create and start an experiment (409 while one of that name runs or is paused); every adapter
    arm must be one the tenant may call (else 404). Audited."""
    message = CreateExperimentRequest(
        tenant_id=_tenant(caller, body.tenant_id), name=body.name, arms=body.arms, actor=actor(caller)
    )
    return await registry_call(request, "experiment_create", message, ExperimentReply)


@router.get("/experiments/{name}", response_model=ExperimentStatusReply, responses=ERRORS)
async def experiment_status(
    request: Request, name: str = NAME, tenant: Identifier | None = None, caller: Principal = Depends(admin_caller)
) -> ExperimentStatusReply:
    """The experiment and each arm's figures since it started (count, share, TTFT p50/p95, TPOT p50,
    engine ms per output token, complaint rate), each with a 95% confidence interval."""
    message = GetExperimentRequest(tenant_id=_tenant(caller, tenant), name=name)
    return await registry_call(request, "experiment_status", message, ExperimentStatusReply)


async def _set_state(
    request: Request, caller: Principal, name: str, tenant: str | None, state: ExperimentState, winner: str | None
) -> ExperimentReply:
    message = ExperimentStateRequest(
        tenant_id=_tenant(caller, tenant), name=name, state=state, winner=winner, actor=actor(caller)
    )
    return await registry_call(request, "experiment_state", message, ExperimentReply)


@router.post("/experiments/{name}/pause", response_model=ExperimentReply, responses=WRITE_ERRORS)
async def pause_experiment(
    body: StateBody, request: Request, name: str = NAME, caller: Principal = Depends(admin_caller)
) -> ExperimentReply:
    """Serve the control (the first arm) to every request until resumed. Audited."""
    return await _set_state(request, caller, name, body.tenant_id, "paused", None)


@router.post("/experiments/{name}/resume", response_model=ExperimentReply, responses=WRITE_ERRORS)
async def resume_experiment(
    body: StateBody, request: Request, name: str = NAME, caller: Principal = Depends(admin_caller)
) -> ExperimentReply:
    """Split by weight again (each user back on its arm). Audited."""
    return await _set_state(request, caller, name, body.tenant_id, "running", None)


@router.post("/experiments/{name}/stop", response_model=ExperimentReply, responses=WRITE_ERRORS)
async def stop_experiment(
    body: StopBody, request: Request, name: str = NAME, caller: Principal = Depends(admin_caller)
) -> ExperimentReply:
    """End the experiment: its winner serves every request that reaches it (``experiment:<name>``, a
    policy's target) from now on. Final. Audited."""
    return await _set_state(request, caller, name, body.tenant_id, "stopped", body.winner)
