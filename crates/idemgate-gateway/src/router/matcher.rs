//! Which requests a route takes: a method set and an exact path or prefix.
//! Built from the config; the router matches every request against it.

/// Which requests a route takes: a method set and an exact path or prefix.
#[derive(Debug, Clone)]
pub struct RouteMatcher {
    /// Empty means every method.
    pub methods: Vec<http::Method>,
    /// The exact path or the prefix it takes.
    pub path: PathMatch,
}

/// The path half of a [`RouteMatcher`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    /// `path`: this path alone.
    Exact(String),
    /// `path_prefix`: every path that starts with this string (a plain
    /// string prefix, not per segment).
    Prefix(String),
}

impl RouteMatcher {
    /// Builds the matcher of a route (`methods`, and `path` or
    /// `path_prefix`), or says why its paths are wrong.
    pub fn new(
        methods: &[String],
        path: Option<&str>,
        path_prefix: Option<&str>,
    ) -> Result<RouteMatcher, String> {
        let path = match (path, path_prefix) {
            (Some(p), None) => PathMatch::Exact(p.to_owned()),
            (None, Some(p)) => PathMatch::Prefix(p.to_owned()),
            (Some(_), Some(_)) => {
                return Err("set either path or path_prefix, not both".into());
            }
            (None, None) => return Err("set path (exact) or path_prefix".into()),
        };
        let text = match &path {
            PathMatch::Exact(p) | PathMatch::Prefix(p) => p,
        };
        if !text.starts_with('/') || text.contains(['?', '#', ' ']) {
            return Err(format!(
                "{text:?} must start with '/' and hold no query, fragment or space"
            ));
        }
        let methods = methods
            .iter()
            .filter_map(|m| m.parse::<http::Method>().ok())
            .collect();
        Ok(RouteMatcher { methods, path })
    }

    /// Whether this route takes a request for `path`.
    pub fn matches_path(&self, path: &str) -> bool {
        match &self.path {
            PathMatch::Exact(p) => p == path,
            PathMatch::Prefix(p) => path.starts_with(p.as_str()),
        }
    }

    /// Whether this route takes `method`.
    pub fn matches_method(&self, method: &http::Method) -> bool {
        self.methods.is_empty() || self.methods.contains(method)
    }

    /// Whether some request would match both.
    pub fn overlaps(&self, other: &RouteMatcher) -> bool {
        let methods_meet = self.methods.is_empty()
            || other.methods.is_empty()
            || self.methods.iter().any(|m| other.methods.contains(m));
        let paths_meet = match (&self.path, &other.path) {
            (PathMatch::Exact(a), PathMatch::Exact(b)) => a == b,
            (PathMatch::Exact(e), PathMatch::Prefix(p))
            | (PathMatch::Prefix(p), PathMatch::Exact(e)) => e.starts_with(p.as_str()),
            (PathMatch::Prefix(a), PathMatch::Prefix(b)) => {
                a.starts_with(b.as_str()) || b.starts_with(a.as_str())
            }
        };
        methods_meet && paths_meet
    }

    /// A route may not be a reserved path or live under one. A shorter
    /// prefix (`/`) may cover it: the gateway answers the reserved path
    /// first, and the route takes everything else.
    pub fn reserved_overlap(&self, reserved: &[&'static str]) -> Option<&'static str> {
        reserved.iter().copied().find(|reserved| match &self.path {
            PathMatch::Exact(p) | PathMatch::Prefix(p) => p.starts_with(reserved),
        })
    }

    /// `POST /orders` or `* /orders/…`, for tables and messages.
    pub fn describe(&self) -> String {
        let methods = if self.methods.is_empty() {
            "*".to_owned()
        } else {
            self.methods
                .iter()
                .map(|m| m.as_str())
                .collect::<Vec<_>>()
                .join(",")
        };
        match &self.path {
            PathMatch::Exact(p) => format!("{methods} {p}"),
            PathMatch::Prefix(p) => format!("{methods} {p}…"),
        }
    }
}
