//! Registering a metric in a Prometheus registry of one's own: every tokentap binary (proxy,
//! worker, control plane, rollout node) keeps one registry per service and registers each name
//! once.

use prometheus::Registry;

/// A counter `name` registered in `registry` (each name once; the other binaries' registries
/// use it too).
pub fn counter_in(registry: &Registry, name: &str, help: &str) -> prometheus::IntCounter {
    registered(
        registry,
        prometheus::IntCounter::new(name, help).expect("valid counter"),
    )
}

/// A gauge `name` registered in `registry` (each name once).
pub fn gauge_in(registry: &Registry, name: &str, help: &str) -> prometheus::IntGauge {
    registered(
        registry,
        prometheus::IntGauge::new(name, help).expect("valid gauge"),
    )
}

/// `metric`, registered in `registry` (each name once).
pub fn registered<C: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: C,
) -> C {
    registry
        .register(Box::new(metric.clone()))
        .expect("unique metric");
    metric
}
