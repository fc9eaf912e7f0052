"""The sageattn3 wheel factory: targets, toolchains, patches, build, repair, tagging,
verification, index and publishing. ``python -m ci --help``; nox sessions call into it."""
