"""Where requests go and how many replicas serve them: the token-aware request router
(`router`, a Serve RequestRouter), the load-aware choice of local or remote prefill
(`prefill_placement`, fed by `load_view`), and the autoscaling policies Serve's controller
runs (`autoscaling`)."""
