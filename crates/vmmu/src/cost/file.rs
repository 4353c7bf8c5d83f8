//! The cost file: JSON text to and from a [`CostModel`], its validation (errors are one line
//! that says what is allowed), and the `sources` that say where each value comes from.

use super::model::{field_index, is_hardware_event, CostModel, HardwareCosts};
use serde::de::Error as _;
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use std::path::Path;

/// The file format version this code reads and writes.
pub const FORMAT: u64 = 1;

/// The keys a cost file's top-level object may have.
const TOP: &str = "format, origin, host, software, hardware, sources";

/// What is wrong with a cost file or a cost: one line that says what is allowed.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    /// The text is not JSON.
    #[error("not valid JSON: {0}")]
    Json(serde_json::Error),
    /// The file could not be read.
    #[error("cost model {path}: cannot read it: {err}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        err: std::io::Error,
    },
    /// What is wrong inside the file at `path`.
    #[error("cost model {path}: {inner}")]
    InFile {
        /// The file.
        path: String,
        /// What is wrong.
        inner: Box<CostError>,
    },
    /// The file could not be written.
    #[error("cannot write cost model {path}: {err}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        err: std::io::Error,
    },
    /// Measurements a fit cannot use (`fit_unit_costs()`, `calibrate()`): what is wrong.
    #[error("{0}")]
    Fit(String),
    /// The top level is not an object.
    #[error("the file must hold a JSON object with the keys {TOP}")]
    NotAnObject,
    /// A key where only others are allowed.
    #[error("unknown key `{key}`; allowed keys: {allowed}")]
    UnknownKey {
        /// The key, with its section.
        key: String,
        /// What that section allows.
        allowed: &'static str,
    },
    /// A `format` this build does not read.
    #[error("`format` is {0}: this vmmu reads format {FORMAT}")]
    Format(Value),
    /// An `origin` that is not a string.
    #[error("`origin` is {0}: it must be a string")]
    Origin(Value),
    /// A host count out of range.
    #[error("`host.{key}` is {value}: it must be a whole number from 1 to 4096")]
    HostCount {
        /// The key in `host`.
        key: String,
        /// Its value.
        value: Value,
    },
    /// A host quantity that is not a finite positive number.
    #[error("`host.{key}` is {value}: it must be a finite positive number")]
    HostPositive {
        /// The key in `host`.
        key: String,
        /// Its value.
        value: Value,
    },
    /// A section that is not an object.
    #[error("`{name}` is {value}: it must be a JSON object")]
    NotASection {
        /// The section.
        name: String,
        /// Its value.
        value: Value,
    },
    /// A cost that is not a number.
    #[error("`{key}` is {value}: costs must be numbers of nanoseconds")]
    NotANumber {
        /// The cost's key.
        key: String,
        /// Its value.
        value: Value,
    },
    /// A cost that is negative, infinite or not a number.
    #[error("`{key}` is {ns}: costs must be finite, non-negative nanoseconds")]
    BadCost {
        /// The cost's key.
        key: String,
        /// Its value.
        ns: f64,
    },
    /// A source that is not a string.
    #[error("`sources.{key}` is {value}: a source must be a string")]
    SourceNotString {
        /// The cost the source is for.
        key: String,
        /// Its value.
        value: Value,
    },
    /// A software cost for a field that is not one (unknown, or a hardware event).
    #[error("{}", unknown_software_key(.0))]
    UnknownSoftwareKey(String),
    /// A hardware cost that is not one.
    #[error("unknown key `hardware.{0}`; allowed hardware keys: {names}", names = HardwareCosts::NAMES.join(", "))]
    UnknownHardwareKey(String),
    /// A cost named neither `software.FIELD` nor `hardware.NAME`.
    #[error("unknown cost `{0}`: costs are named software.FIELD or hardware.NAME")]
    UnknownCost(String),
}

pub(super) fn check_cost(key: &str, ns: f64) -> Result<(), CostError> {
    if ns.is_finite() && ns >= 0.0 {
        Ok(())
    } else {
        Err(CostError::BadCost {
            key: key.into(),
            ns,
        })
    }
}

impl CostModel {
    /// Where the value of `key` (`software.FIELD` or `hardware.NAME`) comes from.
    pub fn source(&self, key: &str) -> Option<&str> {
        self.sources.get(key).map(String::as_str)
    }

    /// Records where the value of `key` (`software.FIELD` or `hardware.NAME`) comes from.
    pub fn set_source(&mut self, key: &str, source: &str) -> Result<(), CostError> {
        check_key(key)?;
        self.sources.insert(key.to_string(), source.to_string());
        Ok(())
    }

    /// The model as the JSON text of a cost file (pretty-printed, keys in a fixed order).
    pub fn to_json_string(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("a cost model serializes");
        s.push('\n');
        s
    }

    /// Parses the JSON text of a cost file. Errors are one line: what is wrong and what is
    /// allowed.
    pub fn from_json_str(text: &str) -> Result<Self, CostError> {
        let v: Value = serde_json::from_str(text).map_err(CostError::Json)?;
        Self::from_value(&v)
    }

    /// Reads a cost file. Errors are one line that names the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, CostError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|err| CostError::Read {
            path: path.display().to_string(),
            err,
        })?;
        Self::from_json_str(&text).map_err(|e| CostError::InFile {
            path: path.display().to_string(),
            inner: Box::new(e),
        })
    }

    /// Writes the model as a cost file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), CostError> {
        let path = path.as_ref();
        std::fs::write(path, self.to_json_string()).map_err(|err| CostError::Write {
            path: path.display().to_string(),
            err,
        })
    }

    fn from_value(v: &Value) -> Result<Self, CostError> {
        let obj = v.as_object().ok_or(CostError::NotAnObject)?;
        let mut m = CostModel {
            origin: String::new(),
            ..CostModel::default()
        };
        for key in obj.keys() {
            if ![
                "format", "origin", "host", "software", "hardware", "sources",
            ]
            .contains(&key.as_str())
            {
                return Err(CostError::UnknownKey {
                    key: key.clone(),
                    allowed: TOP,
                });
            }
        }
        if let Some(f) = obj.get("format") {
            if f.as_u64() != Some(FORMAT) {
                return Err(CostError::Format(f.clone()));
            }
        }
        if let Some(o) = obj.get("origin") {
            m.origin = o
                .as_str()
                .ok_or_else(|| CostError::Origin(o.clone()))?
                .to_string();
        }
        if let Some(h) = obj.get("host") {
            for (key, value) in section(h, "host")? {
                let count = || {
                    value
                        .as_u64()
                        .filter(|n| (1..=4096).contains(n))
                        .map(|n| n as u32)
                        .ok_or_else(|| CostError::HostCount {
                            key: key.clone(),
                            value: value.clone(),
                        })
                };
                let positive = || {
                    value
                        .as_f64()
                        .filter(|x| x.is_finite() && *x > 0.0)
                        .ok_or_else(|| CostError::HostPositive {
                            key: key.clone(),
                            value: value.clone(),
                        })
                };
                match key.as_str() {
                    "sockets" => m.host.sockets = count()?,
                    "cpus_per_socket" => m.host.cpus_per_socket = count()?,
                    "dram_gbps_per_socket" => m.host.dram_gbps_per_socket = positive()?,
                    "dram_latency_ns" => m.host.dram_latency_ns = positive()?,
                    _ => {
                        return Err(CostError::UnknownKey {
                            key: format!("host.{key}"),
                            allowed:
                                "sockets, cpus_per_socket, dram_gbps_per_socket, dram_latency_ns",
                        })
                    }
                }
            }
        }
        if let Some(sw) = obj.get("software") {
            for (field, value) in section(sw, "software")? {
                let key = format!("software.{field}");
                let i = field_index(field)
                    .filter(|i| !is_hardware_event(*i))
                    .ok_or_else(|| CostError::UnknownSoftwareKey(field.clone()))?;
                m.software[i] = cost_value(&key, value)?;
                m.sources.remove(&key);
            }
        }
        if let Some(hw) = obj.get("hardware") {
            for (name, value) in section(hw, "hardware")? {
                let key = format!("hardware.{name}");
                let ns = cost_value(&key, value)?;
                *m.hardware
                    .get_mut(name)
                    .ok_or_else(|| CostError::UnknownHardwareKey(name.clone()))? = ns;
                m.sources.remove(&key);
            }
        }
        if let Some(src) = obj.get("sources") {
            for (part, entries) in section(src, "sources")? {
                if part != "software" && part != "hardware" {
                    return Err(CostError::UnknownKey {
                        key: format!("sources.{part}"),
                        allowed: "software, hardware",
                    });
                }
                for (name, text) in section(entries, &format!("sources.{part}"))? {
                    let key = format!("{part}.{name}");
                    check_key(&key)?;
                    let text = text.as_str().ok_or_else(|| CostError::SourceNotString {
                        key: key.clone(),
                        value: text.clone(),
                    })?;
                    m.sources.insert(key, text.to_string());
                }
            }
        }
        Ok(m)
    }
}

fn section<'v>(v: &'v Value, name: &str) -> Result<&'v serde_json::Map<String, Value>, CostError> {
    v.as_object().ok_or_else(|| CostError::NotASection {
        name: name.into(),
        value: v.clone(),
    })
}

fn cost_value(key: &str, v: &Value) -> Result<f64, CostError> {
    let ns = v.as_f64().ok_or_else(|| CostError::NotANumber {
        key: key.into(),
        value: v.clone(),
    })?;
    check_cost(key, ns)?;
    Ok(ns)
}

/// The message of [`CostError::UnknownSoftwareKey`]: a hardware event names what prices it.
fn unknown_software_key(field: &str) -> String {
    let allowed: Vec<&str> = CostModel::software_fields().collect();
    match field_index(field) {
        Some(_) => {
            let by: Vec<&str> = HardwareCosts::NAMES
                .iter()
                .copied()
                .filter(|n| HardwareCosts::multiplies(n).is_some_and(|f| f.contains(&field)))
                .collect();
            format!(
                "`software.{field}` is not allowed: {field} counts a hardware event, priced by hardware.{}; allowed software keys: {}",
                by.join(" + hardware."),
                allowed.join(", ")
            )
        }
        None => format!(
            "unknown key `software.{field}`; allowed software keys (Meter fields): {}",
            allowed.join(", ")
        ),
    }
}

fn check_key(key: &str) -> Result<(), CostError> {
    match key.split_once('.') {
        Some(("software", f)) => field_index(f)
            .filter(|i| !is_hardware_event(*i))
            .map(|_| ())
            .ok_or_else(|| CostError::UnknownSoftwareKey(f.into())),
        Some(("hardware", n)) => HardwareCosts::NAMES
            .contains(&n)
            .then_some(())
            .ok_or_else(|| CostError::UnknownHardwareKey(n.into())),
        _ => Err(CostError::UnknownCost(key.into())),
    }
}

/// Serializes `(key, value)` pairs as a JSON object in the given order.
struct Ordered<V: Serialize>(Vec<(&'static str, V)>);

impl<V: Serialize> Serialize for Ordered<V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl Serialize for CostModel {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let software = Ordered(
            CostModel::software_fields()
                .map(|f| (f, self.software[field_index(f).expect("a Meter field")]))
                .collect(),
        );
        let hardware = Ordered(
            HardwareCosts::NAMES
                .iter()
                .map(|n| (*n, self.hardware.get(n).expect("a hardware cost")))
                .collect(),
        );
        let src = |part: &str, keys: Vec<&'static str>| {
            Ordered(
                keys.into_iter()
                    .filter_map(|k| {
                        self.sources
                            .get(&format!("{part}.{k}"))
                            .map(|t| (k, t.as_str()))
                    })
                    .collect(),
            )
        };
        let sources = Ordered(vec![
            (
                "software",
                src("software", CostModel::software_fields().collect()),
            ),
            ("hardware", src("hardware", HardwareCosts::NAMES.to_vec())),
        ]);
        let host = Ordered(vec![
            ("sockets", Value::from(self.host.sockets)),
            ("cpus_per_socket", Value::from(self.host.cpus_per_socket)),
            (
                "dram_gbps_per_socket",
                Value::from(self.host.dram_gbps_per_socket),
            ),
            ("dram_latency_ns", Value::from(self.host.dram_latency_ns)),
        ]);
        let mut m = s.serialize_map(Some(6))?;
        m.serialize_entry("format", &FORMAT)?;
        m.serialize_entry("origin", &self.origin)?;
        m.serialize_entry("host", &host)?;
        m.serialize_entry("software", &software)?;
        m.serialize_entry("hardware", &hardware)?;
        m.serialize_entry("sources", &sources)?;
        m.end()
    }
}

impl<'de> Deserialize<'de> for CostModel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        CostModel::from_value(&v).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULT_FILE: &str = include_str!("../../cost-model.default.json");

    #[test]
    fn default_file_equals_the_defaults() {
        let text = CostModel::default().to_json_string();
        if std::env::var_os("VMMU_WRITE_DEFAULT_COST_MODEL").is_some() {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/cost-model.default.json");
            std::fs::write(path, &text).unwrap();
            return;
        }
        assert!(
            DEFAULT_FILE == text,
            "crates/vmmu/cost-model.default.json differs from CostModel::default(); regenerate it with VMMU_WRITE_DEFAULT_COST_MODEL=1 cargo test -p vmmu --lib cost"
        );
        assert_eq!(
            CostModel::from_json_str(DEFAULT_FILE).unwrap(),
            CostModel::default()
        );
    }

    #[test]
    fn json_round_trip() {
        let mut m = CostModel {
            origin: "test".into(),
            ..CostModel::default()
        };
        m.set_software_ns("pf_slow", 123.456).unwrap();
        m.hardware.ipi_ack_ns = 0.0;
        m.set_source("hardware.ipi_ack_ns", "made up").unwrap();
        let back = CostModel::from_json_str(&m.to_json_string()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.source("software.pf_slow"), None);
        assert_eq!(back.source("hardware.ipi_ack_ns"), Some("made up"));
        // Through serde too.
        let v = serde_json::to_value(&m).unwrap();
        let back: CostModel = serde_json::from_value(v).unwrap();
        assert_eq!(back, m);
        // And through a file.
        let path = std::env::temp_dir().join(format!("vmmu-cost-{}.json", std::process::id()));
        m.save(&path).unwrap();
        assert_eq!(CostModel::load(&path).unwrap(), m);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_partial_file_keeps_the_other_defaults() {
        let m = CostModel::from_json_str(r#"{"hardware": {"ipi_send_ns": 7}}"#).unwrap();
        let d = CostModel::default();
        assert_eq!(m.hardware.ipi_send_ns, 7.0);
        assert_eq!(m.hardware.ipi_ack_ns, d.hardware.ipi_ack_ns);
        assert_eq!(m.software_ns("pf_slow"), d.software_ns("pf_slow"));
        assert_eq!(m.source("hardware.ipi_send_ns"), None);
    }

    fn load_err(text: &str) -> String {
        let e = CostModel::from_json_str(text).unwrap_err().to_string();
        assert!(!e.contains('\n'), "not one line: {e}");
        e
    }

    #[test]
    fn load_errors_are_one_line_and_say_what_is_allowed() {
        let e = load_err(r#"{"software": {"pf_slowww": 1}}"#);
        assert!(e.contains("unknown key `software.pf_slowww`"), "{e}");
        assert!(
            e.contains("pf_slow, ") && e.contains("lock_drops_for_alloc"),
            "{e}"
        );
        let e = load_err(r#"{"software": {"tlb_hits": 1}}"#);
        assert!(
            e.contains("tlb_hits counts a hardware event, priced by hardware.tlb_hit_ns"),
            "{e}"
        );
        let e = load_err(r#"{"software": {"flush_kicks": 1}, "hardware": {"ipi": 2}}"#);
        assert!(e.contains("unknown key `hardware.ipi`"), "{e}");
        assert!(e.contains("ipi_send_ns, ipi_ack_ns"), "{e}");
        let e = load_err(r#"{"host": {"sockets": 0}}"#);
        assert!(
            e.contains("`host.sockets` is 0: it must be a whole number"),
            "{e}"
        );
        let e = load_err(r#"{"host": {"numa": 2}}"#);
        assert!(
            e.contains("allowed keys: sockets, cpus_per_socket, dram_gbps"),
            "{e}"
        );
        let e = load_err(r#"{"host": {"dram_latency_ns": -1}}"#);
        assert!(e.contains("must be a finite positive number"), "{e}");
        let m = CostModel::from_json_str(r#"{"host": {"sockets": 4}}"#).unwrap();
        assert_eq!((m.host.sockets, m.host.cpus_per_socket), (4, 48));
        let e = load_err(r#"{"cost": {}}"#);
        assert!(
            e.contains("unknown key `cost`; allowed keys: format"),
            "{e}"
        );
        let e = load_err(r#"{"hardware": {"tlbi_ns": -3}}"#);
        assert_eq!(
            e,
            "`hardware.tlbi_ns` is -3: costs must be finite, non-negative nanoseconds"
        );
        let e = load_err(r#"{"software": {"pf_slow": "fast"}}"#);
        assert!(e.contains("costs must be numbers of nanoseconds"), "{e}");
        let e = load_err("{\"software\": {\n\"pf_slow\": 1,,\n}}");
        assert!(e.starts_with("not valid JSON: "), "{e}");
        assert!(e.contains("line 2"), "{e}");
        let e = load_err(r#"{"format": 2}"#);
        assert!(e.contains("reads format 1"), "{e}");
        let e = load_err(r#"{"sources": {"software": {"nope": "x"}}}"#);
        assert!(e.contains("unknown key `software.nope`"), "{e}");
        let e = load_err("[1, 2]");
        assert!(e.contains("must hold a JSON object"), "{e}");
        // Non-finite values cannot be written in JSON, and the API refuses them too.
        let mut m = CostModel::default();
        let e = m
            .set_software_ns("pf_slow", f64::NAN)
            .unwrap_err()
            .to_string();
        assert!(e.contains("finite, non-negative"), "{e}");
        assert!(m.set_software_ns("guest_reads", 1.0).is_err());
        // A missing file names the file.
        let e = CostModel::load("/nonexistent/vmmu-costs.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("cost model /nonexistent/vmmu-costs.json: cannot read it: "),
            "{e}"
        );
        assert!(!e.contains('\n'));
    }
}
