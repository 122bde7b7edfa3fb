"""One module per way of carrying out a `LaunchPlan`: xla, elastic, inline."""
