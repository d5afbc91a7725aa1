/* Sluice console: chat page. Streams /v1/chat/completions over SSE. */
(function () {
  "use strict";

  var MODEL_STORAGE = "sluice.model";
  var RETRY_MS = 2000;

  var els = {};
  var history = []; // [{role, content}] user/assistant turns, in order
  var controller = null; // AbortController of the answer in flight
  var modelsTimer = null;
  var modelsSeq = 0;
  var chatGen = 0; // bumped by "New chat" so a cancelled answer is dropped

  function $(id) {
    return document.getElementById(id);
  }

  function setStatus(text, isError) {
    els.status.textContent = text || "";
    els.status.classList.toggle("error", !!isError);
  }

  function remember(name, value) {
    try {
      window.localStorage.setItem(name, value);
    } catch (e) {
      /* storage unavailable */
    }
  }

  function recall(name) {
    try {
      return window.localStorage.getItem(name);
    } catch (e) {
      return null;
    }
  }

  /* ---------- models ---------- */

  function scheduleModels(delay) {
    if (modelsTimer) window.clearTimeout(modelsTimer);
    modelsTimer = window.setTimeout(loadModels, delay);
  }

  async function loadModels() {
    modelsTimer = null;
    var seq = ++modelsSeq;
    if (!els.model.options.length) setStatus("Loading models…");
    var body;
    try {
      body = await window.sluice.fetchJSON("/v1/models");
    } catch (err) {
      if (seq !== modelsSeq) return;
      if (err.status === 503) {
        setStatus((err.message || "Server is loading") + " — retrying…", true);
        scheduleModels(RETRY_MS);
      } else if (err.status === 401 || err.status === 403) {
        setStatus(err.message + " — enter an API key above.", true);
      } else if (err.status) {
        setStatus(err.message, true);
      } else {
        setStatus("Cannot reach the server: " + err.message, true);
      }
      return;
    }
    if (seq !== modelsSeq) return;
    fillModels((body && body.data) || []);
  }

  function fillModels(list) {
    var bases = list.filter(function (m) { return !m.parent; });
    var adapters = list.filter(function (m) { return !!m.parent; });
    var previous = els.model.value || recall(MODEL_STORAGE);

    els.model.textContent = "";
    bases.concat(adapters).forEach(function (m) {
      var opt = document.createElement("option");
      opt.value = m.id;
      opt.textContent = m.parent ? m.id + " (adapter on " + m.parent + ")" : m.id;
      els.model.appendChild(opt);
    });

    if (!els.model.options.length) {
      setStatus("The server lists no models.", true);
      return;
    }
    var ids = Array.prototype.map.call(els.model.options, function (o) { return o.value; });
    els.model.value = ids.indexOf(previous) >= 0 ? previous : ids[0];
    syncModelTitle();
    setStatus("");
  }

  function syncModelTitle() {
    var opt = els.model.selectedOptions[0];
    els.model.title = opt ? opt.textContent : "";
  }

  /* ---------- conversation rendering ---------- */

  function nearBottom() {
    var c = els.conversation;
    return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
  }

  function scrollToBottom() {
    els.conversation.scrollTop = els.conversation.scrollHeight;
  }

  function addMessage(role, text) {
    var msg = document.createElement("div");
    msg.className = "message " + role;
    var label = document.createElement("div");
    label.className = "role";
    label.textContent = role === "user" ? "You" : "Assistant";
    var content = document.createElement("div");
    content.className = "content";
    content.textContent = text || "";
    msg.appendChild(label);
    msg.appendChild(content);
    els.conversation.appendChild(msg);
    scrollToBottom();
    return msg;
  }

  function setMeta(msg, text) {
    var meta = msg.querySelector(".meta");
    if (!meta) {
      meta = document.createElement("div");
      meta.className = "meta";
      msg.appendChild(meta);
    }
    meta.textContent = text;
  }

  function showError(msg, text) {
    var stick = nearBottom();
    msg.classList.add("error");
    var content = msg.querySelector(".content");
    if (content.textContent) {
      var note = document.createElement("div");
      note.className = "error-text";
      note.textContent = text;
      msg.insertBefore(note, content.nextSibling);
    } else {
      content.classList.add("is-error");
      content.textContent = text;
    }
    if (stick) scrollToBottom();
  }

  function setBusy(busy) {
    document.body.dataset.state = busy ? "streaming" : "idle";
    els.stop.disabled = !busy;
    els.send.disabled = busy;
  }

  /* ---------- request ---------- */

  function readNumber(input, fallback, min, max, integer) {
    var v = integer ? parseInt(input.value, 10) : parseFloat(input.value);
    if (!isFinite(v)) return fallback;
    if (min !== undefined && v < min) v = min;
    if (max !== undefined && v > max) v = max;
    return v;
  }

  function buildMessages() {
    var messages = [];
    var system = els.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    history.forEach(function (m) {
      messages.push({ role: m.role, content: m.content });
    });
    return messages;
  }

  /* Incremental server-sent-events parser. push() takes decoded text in any
   * chunking; onData is called with each event's joined data field. */
  function SSEParser(onData) {
    this.buffer = "";
    this.data = [];
    this.onData = onData;
  }

  SSEParser.prototype.push = function (text, final) {
    this.buffer += text;
    var re = /\r\n|\n|\r/g;
    var start = 0;
    var m;
    while ((m = re.exec(this.buffer)) !== null) {
      // A lone "\r" at the very end may be the first half of "\r\n".
      if (m[0] === "\r" && m.index === this.buffer.length - 1 && !final) break;
      this.line(this.buffer.slice(start, m.index));
      start = m.index + m[0].length;
    }
    this.buffer = this.buffer.slice(start);
    if (final) {
      if (this.buffer) this.line(this.buffer);
      this.buffer = "";
      this.line("");
    }
  };

  SSEParser.prototype.line = function (line) {
    if (line === "") {
      if (this.data.length) {
        var data = this.data.join("\n");
        this.data = [];
        this.onData(data);
      }
      return;
    }
    if (line.charAt(0) === ":") return; // comment / keep-alive
    var colon = line.indexOf(":");
    var field = colon < 0 ? line : line.slice(0, colon);
    var value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.charAt(0) === " ") value = value.slice(1);
    if (field === "data") this.data.push(value);
  };

  function busyMessage(response, message) {
    var retry = response.headers.get("Retry-After");
    if (response.status === 429) {
      var secs = retry !== null ? Math.ceil(Number(retry)) : NaN;
      if (!isFinite(secs) && retry) {
        var when = Date.parse(retry);
        if (!isNaN(when)) secs = Math.max(0, Math.ceil((when - Date.now()) / 1000));
      }
      return isFinite(secs)
        ? "Server busy, retry in " + secs + " s" + (message ? " (" + message + ")" : "")
        : "Server busy" + (message ? ": " + message : "") + ". Retry shortly.";
    }
    return message;
  }

  function formatMeta(st) {
    var parts = [];
    if (st.ttft !== null) parts.push("TTFT " + st.ttft + " ms");
    if (st.tokens !== null) parts.push(st.tokens + (st.tokens === 1 ? " token" : " tokens"));
    if (st.rate !== null) parts.push(st.rate.toFixed(1) + " tok/s");
    if (st.cached !== null) parts.push(st.cached + " cached prompt tokens");
    if (st.finish && st.finish !== "stop") parts.push(st.finish);
    return parts.join(" · ");
  }

  async function send() {
    if (controller) return;
    var text = els.prompt.value;
    if (!text.trim()) {
      els.prompt.focus();
      return;
    }
    var model = els.model.value;
    if (!model) {
      setStatus("No model selected — the model list has not loaded yet.", true);
      return;
    }

    var userTurn = { role: "user", content: text };
    history.push(userTurn);
    var userMsg = addMessage("user", text);
    els.prompt.value = "";

    var msg = addMessage("assistant", "");
    msg.classList.add("pending");
    var content = msg.querySelector(".content");

    var ctrl = new AbortController();
    var gen = chatGen;
    controller = ctrl;
    setBusy(true);

    var st = {
      ttft: null,
      tokens: null,
      rate: null,
      cached: null,
      finish: null,
    };
    var chunks = 0;
    var tFirst = null;
    var tLast = null;
    var usage = null;
    var errorText = null;
    var done = false;
    var answer = "";
    var t0 = performance.now();

    var parser = new SSEParser(function (data) {
      if (done) return;
      if (data === "[DONE]") {
        done = true;
        return;
      }
      var obj;
      try {
        obj = JSON.parse(data);
      } catch (e) {
        return; // ignore malformed events
      }
      if (obj && obj.error) {
        errorText = (typeof obj.error === "string" ? obj.error : obj.error.message) || "Stream error";
        return;
      }
      if (obj && obj.usage) usage = obj.usage;
      var choices = (obj && obj.choices) || [];
      for (var i = 0; i < choices.length; i++) {
        var ch = choices[i];
        if ((ch.index || 0) !== 0) continue;
        var piece = ch.delta && ch.delta.content;
        if (piece) {
          var now = performance.now();
          if (tFirst === null) {
            tFirst = now;
            st.ttft = Math.round(now - t0);
            msg.classList.remove("pending");
            setMeta(msg, "TTFT " + st.ttft + " ms · streaming…");
          }
          tLast = now;
          chunks += 1;
          answer += piece;
          var stick = nearBottom();
          content.textContent = answer;
          if (stick) scrollToBottom();
        }
        if (ch.finish_reason) st.finish = ch.finish_reason;
      }
    });

    try {
      var response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: window.sluice.headers({ "Content-Type": "application/json" }),
        body: JSON.stringify({
          model: model,
          messages: buildMessages(),
          temperature: readNumber(els.temperature, 0.7, 0, 2, false),
          max_tokens: readNumber(els.maxTokens, 256, 1, undefined, true),
          stream: true,
          stream_options: { include_usage: true },
        }),
        signal: ctrl.signal,
      });
      if (!response.ok) {
        var message = await window.sluice.errorMessage(response);
        errorText = busyMessage(response, message) || "HTTP " + response.status;
      } else if (!response.body) {
        errorText = "The response has no body.";
      } else {
        var reader = response.body.getReader();
        var decoder = new TextDecoder();
        for (;;) {
          var step = await reader.read();
          if (step.done) {
            parser.push(decoder.decode(), true);
            break;
          }
          parser.push(decoder.decode(step.value, { stream: true }), false);
          if (done) {
            reader.cancel().catch(function () {});
            break;
          }
        }
      }
    } catch (err) {
      if (!ctrl.signal.aborted) {
        errorText = "Connection failed: " + (err && err.message ? err.message : String(err));
      }
    }

    var stopped = ctrl.signal.aborted;
    msg.classList.remove("pending");

    if (usage && typeof usage.completion_tokens === "number") {
      st.tokens = usage.completion_tokens;
    } else if (chunks > 0 || !errorText) {
      st.tokens = chunks;
    }
    if (usage && usage.prompt_tokens_details &&
        typeof usage.prompt_tokens_details.cached_tokens === "number") {
      st.cached = usage.prompt_tokens_details.cached_tokens;
    }
    if (st.tokens !== null && st.tokens >= 2 && tFirst !== null && tLast > tFirst) {
      st.rate = Math.round(((st.tokens - 1) / ((tLast - tFirst) / 1000)) * 10) / 10;
    }

    if (!errorText && !stopped && !st.finish && !done) {
      errorText = "The connection closed before the answer finished.";
    }
    if (errorText) {
      st.finish = "error";
      showError(msg, errorText);
    } else if (stopped) {
      st.finish = "stopped";
      msg.classList.add("stopped");
    } else if (!st.finish) {
      st.finish = "stop";
    }

    if (st.ttft !== null) msg.dataset.ttftMs = String(st.ttft);
    if (st.tokens !== null) msg.dataset.tokens = String(st.tokens);
    if (st.rate !== null) msg.dataset.tokensPerS = st.rate.toFixed(1);
    if (st.cached !== null) msg.dataset.cachedTokens = String(st.cached);
    msg.dataset.finish = st.finish;
    setMeta(msg, formatMeta(st));

    // Keep the history consistent: a turn that produced an answer (complete or
    // partial) stays; a failed or empty one is left out of later requests.
    if (gen !== chatGen) {
      // "New chat" was pressed while this answer streamed: nothing to keep.
    } else if (answer && st.finish !== "error") {
      history.push({ role: "assistant", content: answer });
    } else {
      var idx = history.indexOf(userTurn);
      if (idx >= 0) history.splice(idx, 1);
      userMsg.classList.add("excluded");
      userMsg.title = "Not part of the conversation sent to the model (no answer).";
    }

    if (controller === ctrl) {
      controller = null;
      setBusy(false);
    }
    if (nearBottom()) scrollToBottom();
  }

  function stop() {
    if (controller) controller.abort();
  }

  function clearChat() {
    if (controller) {
      var ctrl = controller;
      controller = null;
      ctrl.abort();
      setBusy(false);
    }
    chatGen += 1;
    history = [];
    els.conversation.textContent = "";
    els.prompt.focus();
  }

  /* ---------- wiring ---------- */

  function init() {
    els.model = $("model");
    els.status = $("status");
    els.system = $("system");
    els.temperature = $("temperature");
    els.maxTokens = $("max-tokens");
    els.prompt = $("prompt");
    els.send = $("send");
    els.stop = $("stop");
    els.clear = $("clear");
    els.form = $("chat-form");
    els.conversation = $("conversation");

    setBusy(false);

    els.form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      send();
    });
    els.prompt.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && !ev.altKey && !ev.ctrlKey && !ev.metaKey) {
        ev.preventDefault();
        if (!controller) send();
      }
    });
    els.stop.addEventListener("click", stop);
    els.clear.addEventListener("click", clearChat);
    els.model.addEventListener("change", function () {
      remember(MODEL_STORAGE, els.model.value);
      syncModelTitle();
    });
    window.addEventListener("sluice:apikey", function () {
      scheduleModels(0);
    });

    loadModels();
    els.prompt.focus();
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
