"""At-scale simulation: model and hardware specs and a roofline cost model of one decoding step."""
