"""The onboarding job, the sensor that adds registry models as partitions, and the revision schedule."""


from pipelines.orchestration.automation import onboard_job, registry_sensor, revisions_schedule

__all__ = ["onboard_job", "registry_sensor", "revisions_schedule"]
