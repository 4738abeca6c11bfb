//! The hosts of a database URL, as libpq takes them
//! (`postgres://u@h1:5432,h2:5432/db?target_session_attrs=read-write`)
//! and as a Galera cluster's nodes are named (`mysql://u@n1,n2,n3/db`):
//! sqlx takes one host, so the list is split here, for the pool's primary
//! watcher (`sql/primary.rs`) and the waiters' `LISTEN` connection
//! (`settle.rs`), which both try the hosts in turn.

/// The hosts a database URL names, and the URL with only the first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hosts {
    /// `(host, port)` in the URL's order.
    pub(crate) list: Vec<(String, u16)>,
    /// The URL as sqlx reads it: the first host only, and without
    /// `target_session_attrs` (a writable server is always the target).
    pub(crate) first: String,
    /// The same for each host, in the URL's order.
    pub(crate) each: Vec<String>,
}

/// Splits a libpq-style host list (`h1:5432,h2,[::1]:5433`) out of `url`.
/// A URL with one host comes back as it was (without
/// `target_session_attrs`).
pub(crate) fn hosts(url: &str) -> Result<Hosts, String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| format!("{url:?} is not a URL"))?;
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (userinfo, hostlist) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (Some(user), hosts),
        None => (None, authority),
    };
    if hostlist.is_empty() {
        // A Unix socket (`postgres:///db?host=/run/postgresql`): sqlx
        // reads it as it is.
        return Ok(Hosts {
            list: Vec::new(),
            first: url.to_owned(),
            each: vec![url.to_owned()],
        });
    }
    let default_port = match scheme {
        "mysql" | "mariadb" => 3306,
        _ => 5432,
    };
    let mut list = Vec::new();
    for host in hostlist.split(',') {
        let (name, port) = match host.rsplit_once(':') {
            Some((name, port)) if !port.contains(']') => {
                let port = port
                    .parse::<u16>()
                    // Not echoed: a password with an unescaped `/` would show.
                    .map_err(|_| "an invalid port in the database URL".to_owned())?;
                (name, port)
            }
            _ => (host, default_port),
        };
        if name.is_empty() {
            return Err("a host of the database URL is empty".into());
        }
        list.push((name.trim_matches(['[', ']']).to_owned(), port));
    }
    let tail = without_param(tail, "target_session_attrs");
    let urls = list
        .iter()
        .map(|(name, port)| {
            let host = if name.contains(':') {
                format!("[{name}]:{port}")
            } else {
                format!("{name}:{port}")
            };
            match userinfo {
                Some(user) => format!("{scheme}://{user}@{host}{tail}"),
                None => format!("{scheme}://{host}{tail}"),
            }
        })
        .collect::<Vec<_>>();
    Ok(Hosts {
        list,
        first: urls[0].clone(),
        each: urls,
    })
}

/// One URL per host of `url`, in its order (for connections made outside
/// the pool, such as the `LISTEN` connection); `url` itself when it does
/// not parse.
#[cfg(feature = "postgres")]
pub(crate) fn each_host_url(url: &str) -> Vec<String> {
    hosts(url).map_or_else(|_| vec![url.to_owned()], |h| h.each)
}

/// `tail` (`/db?a=1&b=2`) without the query parameter `name`.
fn without_param(tail: &str, name: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else {
        return tail.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| pair.split('=').next() != Some(name))
        .collect();
    if kept.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", kept.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_list_is_split_and_the_url_keeps_the_first() {
        let h = hosts("postgres://u:p@h1:5432,h2:5433,[::1]/db?target_session_attrs=read-write&sslmode=disable").unwrap();
        assert_eq!(
            h.list,
            vec![
                ("h1".to_owned(), 5432),
                ("h2".to_owned(), 5433),
                ("::1".to_owned(), 5432)
            ]
        );
        assert_eq!(h.first, "postgres://u:p@h1:5432/db?sslmode=disable");
    }

    #[test]
    fn one_host_keeps_its_url() {
        let h = hosts("postgres://postgres@127.0.0.1:5432/test?options[search_path]=s").unwrap();
        assert_eq!(h.list, vec![("127.0.0.1".to_owned(), 5432)]);
        assert_eq!(
            h.first,
            "postgres://postgres@127.0.0.1:5432/test?options[search_path]=s"
        );
        let h = hosts("postgres://db.internal/test?target_session_attrs=read-write").unwrap();
        assert_eq!(h.list, vec![("db.internal".to_owned(), 5432)]);
        assert_eq!(h.first, "postgres://db.internal:5432/test");
    }

    #[test]
    fn a_unix_socket_url_is_left_as_it_is() {
        for url in [
            "postgres:///db?host=/run/postgresql",
            "postgres://u@/db?host=/run/postgresql",
        ] {
            let h = hosts(url).unwrap();
            assert!(h.list.is_empty());
            assert_eq!(h.first, url);
        }
    }

    #[test]
    fn mysql_hosts_default_to_its_port() {
        let h = hosts("mysql://root@n1,n2:3307/test").unwrap();
        assert_eq!(
            h.list,
            vec![("n1".to_owned(), 3306), ("n2".to_owned(), 3307)]
        );
        assert_eq!(h.first, "mysql://root@n1:3306/test");
    }

    #[test]
    fn a_bad_port_is_named() {
        let e = hosts("postgres://u:p@h1:5432,h2:x/db").unwrap_err();
        assert!(e.contains("invalid port"), "{e}");
        assert!(!e.contains('x'), "{e}");
    }
}
