"""hlat_operator: the kopf operator that runs PretrainJobs (thin handlers -> pure reconcile ->
k8s I/O). Built in the operator issue; it imports hlat_api, never the trainer."""
