/* Sluice console: shared helpers for the chat and dashboard pages.
 * Plain script (not a module); defines window.sluice. */
(function () {
  "use strict";

  var KEY_STORAGE = "sluice.apiKey";

  function readStorage(name) {
    try {
      return window.localStorage.getItem(name);
    } catch (e) {
      return null;
    }
  }

  function writeStorage(name, value) {
    try {
      if (value === null || value === undefined || value === "") {
        window.localStorage.removeItem(name);
      } else {
        window.localStorage.setItem(name, value);
      }
    } catch (e) {
      /* storage unavailable (private mode, quota): keep going without it */
    }
  }

  function apiKey() {
    return readStorage(KEY_STORAGE) || "";
  }

  function setApiKey(k) {
    var key = (k || "").trim();
    var before = apiKey();
    writeStorage(KEY_STORAGE, key);
    if (key !== before) {
      window.dispatchEvent(new CustomEvent("sluice:apikey", { detail: { apiKey: key } }));
    }
  }

  function headers(extra) {
    var h = {};
    var key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    if (extra) {
      Object.keys(extra).forEach(function (name) {
        h[name] = extra[name];
      });
    }
    return h;
  }

  /* Read an OpenAI-style error body ({"error": {"message": ...}}) from a
   * failed response; falls back to the status text. */
  async function errorMessage(response) {
    var message = "";
    try {
      var text = await response.text();
      if (text) {
        try {
          var body = JSON.parse(text);
          if (body && body.error) {
            message = typeof body.error === "string" ? body.error : body.error.message || "";
          } else if (body && typeof body.detail === "string") {
            message = body.detail;
          }
        } catch (e) {
          /* not JSON */
        }
      }
    } catch (e) {
      /* body unreadable */
    }
    if (!message) {
      message = response.statusText || "HTTP " + response.status;
    }
    return message;
  }

  async function fetchJSON(url, opts) {
    var options = Object.assign({}, opts || {});
    options.headers = headers(options.headers);
    var response = await fetch(url, options);
    if (!response.ok) {
      var err = new Error(await errorMessage(response));
      err.status = response.status;
      err.retryAfter = response.headers.get("Retry-After");
      throw err;
    }
    if (response.status === 204) return null;
    return response.json();
  }

  function wireHeader() {
    var path = window.location.pathname.replace(/\/+$/, "") || "/";
    document.querySelectorAll("header nav a[href]").forEach(function (a) {
      var href = a.getAttribute("href").replace(/\/+$/, "") || "/";
      if (href === path) {
        a.setAttribute("aria-current", "page");
      } else {
        a.removeAttribute("aria-current");
      }
    });

    var input = document.getElementById("api-key");
    if (!input) return;
    input.value = apiKey();
    input.addEventListener("change", function () {
      setApiKey(input.value);
    });
    input.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter") {
        ev.preventDefault();
        setApiKey(input.value);
      }
    });
    if (input.form) {
      input.form.addEventListener("submit", function (ev) {
        ev.preventDefault();
        setApiKey(input.value);
      });
    }
  }

  window.sluice = {
    apiKey: apiKey,
    setApiKey: setApiKey,
    headers: headers,
    fetchJSON: fetchJSON,
    errorMessage: errorMessage,
  };

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", wireHeader);
  } else {
    wireHeader();
  }
})();
