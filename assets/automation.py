"""The onboarding and observation jobs, the sensors (new registry models, changed upstream revisions, changed
recipes) and the revision schedule."""


from pipelines.orchestration.automation import (
                                                observe_revisions_job,
                                                onboard_job,
                                                recipe_sensor,
                                                registry_sensor,
                                                revision_sensor,
                                                revisions_schedule,
)

__all__ = ["observe_revisions_job", "onboard_job", "recipe_sensor", "registry_sensor", "revision_sensor",
           "revisions_schedule"]
