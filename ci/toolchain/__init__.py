"""The matrix and what a target needs to build: targets and variants, the toolchain found or provisioned, flags, patches, cross and Windows toolchains."""
