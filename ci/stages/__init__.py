"""The stages of a build, each leaving an artifact on disk: plan and resolve, build, repair, tag, record, verify, index (ci/index)."""
