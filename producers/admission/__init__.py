"""``gpuledger admit``: control 1 as prevention — a validating admission webhook and a Kueue AdmissionCheck controller.

Modules: ``config`` (settings, env ``GPULEDGER_ADMIT_*``), ``certs`` (the self-signed serving
certificate), ``events`` (a decision as an ``admission.decided`` event), ``webhook`` (the
AdmissionReview endpoint, pure request → response), ``controller`` (the AdmissionCheck
controller), ``service`` (one process: HTTPS server, release-topic follower, controller,
decision recorder). The decision itself is ``streams.controls.admission.decide``.
"""
