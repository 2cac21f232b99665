"""The HTTP planning service (`fastddrive serve`): routes in app.py, the model worker and its bounded queue in
worker.py, request and answer models in schemas.py, Prometheus metrics in metrics.py, the page in page.html,
and the load test in loadtest.py."""
