"""The models: the frozen target (loading, hidden-state features), the DFlash drafter, its
attention masks and objective, the export in the published draft layout."""
